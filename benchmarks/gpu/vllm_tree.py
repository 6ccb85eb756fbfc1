"""vLLM's tree for the GPU host, taken from the official ``vllm==0.32.0`` wheel without its compiled parts.

What travels: the ``vllm/`` Python files and the data files it reads (JSON kernel configs, chat templates),
and the wheel's ``vllm-0.32.0.dist-info`` without ``RECORD`` (it lists the ``.so`` files left behind).
``importlib.metadata.version("vllm")`` then reads ``0.32.0``, without ``cpu``, so vLLM's platform detection
takes the CUDA platform when NVML sees a GPU. What does not: the 13 ``.so`` files (626 MiB), the ``vllm-rs``
binary, C++/CUDA headers and sources, the offline Swagger UI, images and READMEs.

Two changes to the copied tree, each checked against the exact text of vLLM 0.32.0 (the build fails if the
text moved, rather than shipping an unpatched tree):

1. ``vllm/_C_stable_libtorch.py``: ``benchmarks/gpu/stub/_C_stable_libtorch.py`` in place of the compiled
   extension that ``vllm/platforms/cuda.py`` imports unconditionally (line 23).
2. ``vllm/vllm_flash_attn/__init__.py`` raises ImportError when neither ``_vllm_fa2_C`` nor ``_vllm_fa3_C``
   loads, and ``v1/attention/backends/fa_utils.py`` imports it whenever the platform is CUDA, which every
   attention backend's module reaches. The patch turns the raise into a log line: the module imports with
   ``FA2_AVAILABLE = FA3_AVAILABLE = False``, so ``is_fa_version_supported`` answers False and vLLM's
   selector never picks FLASH_ATTN; a direct call of ``flash_attn_varlen_func`` still fails inside vLLM's
   interface (its ``_vllm_fa2_C`` ops are missing), loudly.
"""

from __future__ import annotations

import ast
import shutil
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

STUB = Path(__file__).with_name("stub") / "_C_stable_libtorch.py"
STUB_TARGET = "vllm/_C_stable_libtorch.py"
#: Files of the ``vllm/`` package that travel, by suffix.
KEPT_SUFFIXES = (".py", ".json", ".jinja", ".sh", "py.typed")
DIST_INFO_DROPPED = ("RECORD",)

FLASH_ATTN_INIT = "vllm/vllm_flash_attn/__init__.py"
FLASH_ATTN_RAISE = '''if not (FA2_AVAILABLE or FA3_AVAILABLE):
    raise ImportError(
        "vllm.vllm_flash_attn requires the CUDA flash attention extensions "
        "(_vllm_fa2_C or _vllm_fa3_C). On ROCm, use upstream flash_attn."
    )
'''
FLASH_ATTN_PATCHED = '''if not (FA2_AVAILABLE or FA3_AVAILABLE):
    # vllm-kvevict GPU bundle (benchmarks/gpu/vllm_tree.py): no compiled FlashAttention travels. The module
    # imports with FA2_AVAILABLE = FA3_AVAILABLE = False, so vLLM's selector never picks FLASH_ATTN.
    import logging as _logging

    _logging.getLogger(__name__).info(
        "vllm_flash_attn: no _vllm_fa2_C/_vllm_fa3_C; FlashAttention unavailable (GPU bundle)"
    )
'''


@dataclass
class TreeReport:
    """What the extraction kept and left out: file counts and uncompressed bytes."""

    kept_files: int = 0
    kept_bytes: int = 0
    dropped_files: int = 0
    dropped_bytes: int = 0
    dropped_largest: list[tuple[str, int]] = field(default_factory=list)
    patches: list[str] = field(default_factory=list)


def travels(name: str) -> bool:
    """Whether a wheel member goes into the bundle's tree."""
    path = PurePosixPath(name)
    if path.parts[0].endswith(".dist-info"):
        return path.name not in DIST_INFO_DROPPED
    return path.parts[0] == "vllm" and name.endswith(KEPT_SUFFIXES)


def patch_text(path: Path, original: str, replacement: str) -> None:
    """Replace ``original`` (which must occur exactly once) in ``path``."""
    text = path.read_text()
    if text.count(original) != 1:
        raise RuntimeError(
            f"{path}: expected the vLLM 0.32.0 text once, found it {text.count(original)} times; "
            "the patch in benchmarks/gpu/vllm_tree.py no longer matches this vLLM"
        )
    path.write_text(text.replace(original, replacement))


def extract_tree(wheel: Path, dest: Path) -> TreeReport:
    """vLLM's Python tree from ``wheel`` into ``dest`` (``dest/vllm``, ``dest/vllm-0.32.0.dist-info``),
    with the compiled-module stub and the FlashAttention import patch."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    report = TreeReport()
    dropped: list[tuple[str, int]] = []
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            if info.is_dir():
                continue
            if travels(info.filename):
                archive.extract(info, dest)
                report.kept_files += 1
                report.kept_bytes += info.file_size
            else:
                dropped.append((info.filename, info.file_size))
    report.dropped_files = len(dropped)
    report.dropped_bytes = sum(size for _, size in dropped)
    report.dropped_largest = sorted(dropped, key=lambda item: -item[1])[:8]

    target = dest / STUB_TARGET
    if target.exists():
        raise RuntimeError(f"{target} exists in the wheel: vLLM's layout changed")
    shutil.copyfile(STUB, target)
    report.patches.append(f"{STUB_TARGET}: benchmarks/gpu/stub/_C_stable_libtorch.py")
    patch_text(dest / FLASH_ATTN_INIT, FLASH_ATTN_RAISE, FLASH_ATTN_PATCHED)
    report.patches.append(f"{FLASH_ATTN_INIT}: ImportError without _vllm_fa2_C/_vllm_fa3_C -> log line")
    return report


def stub_op_names(stub: Path = STUB) -> list[str]:
    """Names of the ops the stub registers (its ``OPS`` keys), read without importing it."""
    for node in ast.parse(stub.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "OPS" for t in node.targets):
            return [ast.literal_eval(key).split("(", 1)[0] for key in node.value.keys]
    raise RuntimeError(f"{stub} defines no OPS")
