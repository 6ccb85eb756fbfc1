"""Names of the configurations a comparison runs: our vLLM servers and kvpress presses, one results file each.

``vllm-vanilla``, ``vllm-<method>-<kept>`` (e.g. ``vllm-ada-snapkv-0.25``), ``kvpress-<press>-<mode>-<kept>``
(e.g. ``kvpress-snapkv-aware-0.25``; ``kvpress-none-aware-1`` is HF transformers with the full cache). The
kvpress script (``scripts/kvpress_eval/run_kvpress.py``) writes the same names.
"""

from __future__ import annotations

from dataclasses import dataclass

SYSTEMS = ("vllm", "kvpress")
MODES = ("aware", "agnostic")


@dataclass(frozen=True)
class EvalConfig:
    """One row of the comparison: who answers (``system``), with which ``method`` at which ``kept`` fraction.

    ``mode`` says whether the question is inside the compressed prompt (``aware``; always so for a vLLM
    server, which evicts after the whole prompt) or appended after compression (``agnostic``)."""

    system: str
    method: str
    kept: float
    mode: str = "aware"

    def __post_init__(self) -> None:
        if self.system not in SYSTEMS:
            raise ValueError(f"unknown system {self.system!r}; valid systems: {', '.join(SYSTEMS)}")
        if self.mode not in MODES:
            raise ValueError(f"unknown mode {self.mode!r}; valid modes: {', '.join(MODES)}")
        if self.system == "vllm" and self.mode != "aware":
            raise ValueError("a vLLM server always compresses the whole prompt: mode must be 'aware'")
        if not 0.0 < self.kept <= 1.0:
            raise ValueError(f"kept fraction {self.kept} must lie in (0, 1]")

    @property
    def is_full_cache(self) -> bool:
        return self.method in ("vanilla", "none")

    @property
    def name(self) -> str:
        if self.system == "vllm":
            return "vllm-vanilla" if self.is_full_cache else f"vllm-{self.method}-{self.kept:g}"
        return f"kvpress-{self.method}-{self.mode}-{self.kept:g}"

    @property
    def line(self) -> str:
        """Legend entry shared by all budgets of a method, e.g. ``ours (vLLM) snapkv``."""
        if self.system == "vllm":
            return "ours (vLLM) full cache" if self.is_full_cache else f"ours (vLLM) {self.method}"
        if self.is_full_cache:
            return "kvpress/HF full cache"
        return f"kvpress {self.method} {self.mode}"

    @classmethod
    def parse(cls, name: str) -> EvalConfig:
        """The configuration called ``name`` (inverse of :attr:`name`)."""
        system, _, rest = name.partition("-")
        try:
            if system == "vllm":
                if rest == "vanilla":
                    return cls("vllm", "vanilla", 1.0)
                method, _, kept = rest.rpartition("-")
                return cls("vllm", method, float(kept))
            if system == "kvpress":
                head, _, kept = rest.rpartition("-")
                method, _, mode = head.rpartition("-")
                return cls("kvpress", method, float(kept), mode)
        except ValueError as exc:
            raise ValueError(f"bad configuration name {name!r}: {exc}") from None
        raise ValueError(f"bad configuration name {name!r}: expected vllm-... or kvpress-...")
