"""Answer evaluation samples with kvpress presses (HF transformers), for the side-by-side quality table.

Runs in the kvpress reference environment (``.venv-ref``: kvpress 0.5.5, transformers < 5.3), which cannot
share a process with vLLM; it reads the samples file written by ``vllm-kvevict eval`` (prompts as token ids)
and writes raw outputs, one JSON-lines file per configuration. Scoring happens on the main side.

Modes, per sample (prompt = context + question + chat-template tail + answer prefix):
  aware     the whole prompt is prefilled under the press and compressed, the first token comes from that
            prefill; exactly what a vLLM server evicting after prefill does (question inside the compressed
            part, kvpress's query-aware setting).
  agnostic  only the context is prefilled and compressed; the question and the rest follow uncompressed
            (kvpress pipeline's ``question=`` setting).
Generation is greedy with true position ids after compression, as kvpress's own pipeline does.

Usage: run_kvpress.py --model-dir DIR --samples FILE --output-dir DIR --configs snapkv:0.25:aware,...
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from kvpress import (
    AdaKVPress,
    CriticalAdaKVPress,
    CriticalKVPress,
    PyramidKVPress,
    SnapKVPress,
    StreamingLLMPress,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

# Aligned with vllm_kvevict's policy defaults (window 32, pooling kernel 7, Ada alpha 0.2, CriticalKV
# first-stage 0.5 / eps 1e-4, 4 sinks). kvpress pools with an average, ours with a max: a known difference.
WINDOW = 32
KERNEL = 7


def _snapkv(ratio: float) -> SnapKVPress:
    return SnapKVPress(compression_ratio=ratio, window_size=WINDOW, kernel_size=KERNEL)


class NoPress:
    """Full cache (no compression): the HF baseline that checks this script against vanilla vLLM."""

    def __call__(self, model):
        return contextlib.nullcontext()


PRESSES: dict[str, Callable[[float], object]] = {
    "none": lambda r: NoPress(),
    "snapkv": _snapkv,
    "pyramidkv": lambda r: PyramidKVPress(compression_ratio=r, window_size=WINDOW, kernel_size=KERNEL),
    "ada-snapkv": lambda r: AdaKVPress(_snapkv(r), alpha_safeguard=0.2),
    "critical-snapkv": lambda r: CriticalKVPress(_snapkv(r), epsilon=1e-4, first_stage_ratio=0.5),
    "critical-ada-snapkv": lambda r: CriticalAdaKVPress(
        _snapkv(r), alpha_safeguard=0.2, epsilon=1e-4, first_stage_ratio=0.5
    ),
    "streamingllm": lambda r: StreamingLLMPress(compression_ratio=r, n_sink=4),
}
MODES = ("aware", "agnostic")


def parse_config(text: str) -> tuple[str, float, str]:
    """``"snapkv:0.25:aware"`` -> (press, kept fraction, mode), validated."""
    parts = text.split(":")
    if len(parts) != 3:
        raise SystemExit(f"bad config {text!r}: expected PRESS:KEPT_FRACTION:MODE, e.g. snapkv:0.25:aware")
    press, kept, mode = parts[0], float(parts[1]), parts[2]
    if press not in PRESSES:
        raise SystemExit(f"unknown press {press!r}; valid presses: {', '.join(PRESSES)}")
    if press == "none" and kept != 1.0:
        raise SystemExit(
            f"bad kept fraction {kept} in {text!r}: press 'none' keeps everything, use none:1:aware"
        )
    if press != "none" and not 0.0 < kept < 1.0:
        raise SystemExit(f"bad kept fraction {kept} in {text!r}: must lie in (0, 1)")
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}; valid modes: {', '.join(MODES)}")
    return press, kept, mode


def config_name(press: str, kept: float, mode: str) -> str:
    """File stem and label of a configuration; the main side parses the same form."""
    return f"kvpress-{press}-{mode}-{kept:g}"


def _uniform_layers(cache: DynamicCache, num_layers: int) -> bool:
    """Whether every layer of ``cache`` holds the same number of entries."""
    return len({cache.get_seq_length(layer) for layer in range(num_layers)}) == 1


@torch.inference_mode()
def answer(model, token_ids: list[int], compress_upto: int, press, max_new_tokens: int, eos: set[int]):
    """Greedy answer, the first ``compress_upto`` tokens prefilled under ``press``; returns (ids, kept)."""
    cache = DynamicCache()
    with press(model):
        out = model(
            input_ids=torch.tensor([token_ids[:compress_upto]]), past_key_values=cache, logits_to_keep=1
        )
    kept = cache.get_seq_length()
    position = compress_upto
    rest = token_ids[compress_upto:]
    # transformers builds a multi-token chunk's mask from layer 0's cache length, which fails when the
    # press left layers of different lengths (PyramidKV); one token at a time needs no mask.
    chunk = max(1, len(rest)) if _uniform_layers(cache, model.config.num_hidden_layers) else 1
    for start in range(0, len(rest), chunk):
        piece = rest[start : start + chunk]
        positions = torch.arange(position, position + len(piece)).unsqueeze(0)
        out = model(
            input_ids=torch.tensor([piece]), past_key_values=cache, position_ids=positions, logits_to_keep=1
        )
        position += len(piece)
    generated = [int(out.logits[0, -1].argmax())]
    while len(generated) < max_new_tokens and generated[-1] not in eos:
        out = model(
            input_ids=torch.tensor([[generated[-1]]]),
            past_key_values=cache,
            position_ids=torch.tensor([[position]]),
        )
        position += 1
        generated.append(int(out.logits[0, -1].argmax()))
    return generated, kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", required=True, type=Path)
    parser.add_argument("--samples", required=True, type=Path)
    parser.add_argument("--output-dir", required=True, type=Path)
    parser.add_argument("--configs", required=True, help="comma list of PRESS:KEPT_FRACTION:MODE")
    parser.add_argument(
        "--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="bf16 as vLLM serves"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: fastest on a shared CPU)")
    args = parser.parse_args(argv)

    configs = [parse_config(c) for c in args.configs.split(",") if c.strip()]
    samples = [json.loads(line) for line in args.samples.read_text().splitlines() if line.strip()]
    torch.set_num_threads(args.threads)
    transformers.utils.logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=getattr(torch, args.dtype))
    model.eval()
    eos = {int(model.generation_config.eos_token_id)}
    args.output_dir.mkdir(parents=True, exist_ok=True)
    for press_name, kept_fraction, mode in configs:
        name = config_name(press_name, kept_fraction, mode)
        path = args.output_dir / f"{name}.raw.jsonl"
        if path.exists() and len(path.read_text().splitlines()) == len(samples):
            print(f"{name}: complete, skipped", file=sys.stderr)
            continue
        press = PRESSES[press_name](1.0 - kept_fraction)
        started = time.perf_counter()
        with open(path.with_suffix(".tmp"), "w") as out:
            for i, sample in enumerate(samples):
                ids = sample["token_ids"]
                upto = len(ids) if mode == "aware" else sample["context_tokens"]
                t0 = time.perf_counter()
                generated, kept = answer(model, ids, upto, press, sample["max_new_tokens"], eos)
                record = {
                    "config": name,
                    "sample_id": sample["id"],
                    "output": tokenizer.decode(generated, skip_special_tokens=True),
                    "prompt_tokens": len(ids),
                    "kept_tokens": kept,
                    "latency_s": time.perf_counter() - t0,
                }
                out.write(json.dumps(record) + "\n")
                print(f"{name}: {i + 1}/{len(samples)}", file=sys.stderr, flush=True)
        path.with_suffix(".tmp").rename(path)
        print(f"{name}: {len(samples)} samples in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
