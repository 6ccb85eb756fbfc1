"""Policy-level quality: needle retrieval on the bundled model for every method and kept fraction, with
kvpress 0.5.5's presses on the same prompts.

Per prompt: one full-attention prefill in HF transformers captures every layer's keys, values and all
queries (``vllm_kvevict.hf_reference``). Each method then selects kept tokens per (layer, KV head) at each
kept fraction, in two modes - question-aware (the whole prompt, question included, is compressed; the first
answer token comes from the full prefill as in vLLM) and question-agnostic (only the context before the
question is compressed; the question is run on the evicted cache). kvpress's presses (their defaults:
window 64, average pooling 5) choose their kept sets on the same tensors in ``.venv-ref``
(``scripts/kvpress_reference/kept_indices.py``). Every kept set is then decoded greedily by the same masked
runner, several sets per batch. Results go to a JSON-lines file, one line per (prompt, mode, method,
fraction); a prompt already in the file is skipped, so the run can be resumed.

    nice -n 10 .venv/bin/python benchmarks/policy_quality/run.py \\
        --out docs/results/policy-quality/results.jsonl
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from needle import NeedlePrompt, is_correct, needle_prompt  # noqa: E402
from score_cache import reused_scores  # noqa: E402

from vllm_kvevict.hf_reference import (  # noqa: E402
    PrefilledPrompt,
    context_layers,
    decode_batch_with_kept,
    kept_per_layer,
    kvpress_kept_count,
    load_reference_model,
    prefill,
)
from vllm_kvevict.policies.base import KeptTokens, LayerKV  # noqa: E402
from vllm_kvevict.policies.query_statistics import unrotate  # noqa: E402
from vllm_kvevict.policies.registry import build_policy, method_names  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
KVPRESS_SCRIPT = ROOT / "scripts" / "kvpress_reference" / "kept_indices.py"
KVPRESS_PRESSES = (
    "snapkv",
    "pyramidkv",
    "ada-snapkv",
    "critical-snapkv",
    "critical-ada-snapkv",
    "streamingllm",
)
KVPRESS_WINDOW = 64
MODES = ("question-aware", "question-agnostic")
MAX_NEW_TOKENS = 10


def answer_decided(expected: str, tokenizer):
    """``finished`` callback: stop a row once its digits are the answer or have left it (greedy decoding
    is deterministic, so the verdict cannot change after that)."""

    def finished(tokens: list[int]) -> bool:
        text = tokenizer.decode(tokens, skip_special_tokens=True).lstrip()
        digits = ""
        for char in text:
            if not char.isdigit():
                break
            digits += char
        if not digits:
            return False
        return digits == expected or not expected.startswith(digits) or len(digits) < len(text)

    return finished


#: kvpress's Expected Attention presses: they read every position's query before RoPE.
KVPRESS_EXPECTED = ("expected-attention", "ada-expected-attention")


def write_kvpress_case(path: Path, layers: list[LayerKV], prerope: bool = False) -> None:
    """The kvpress script's input for ``layers``; ``prerope``: with every position's pre-RoPE query and the
    RoPE frequencies (the Expected Attention presses; ``layers`` must then hold every prompt query)."""
    entries = []
    for layer in layers:
        entry = {
            "keys": layer.keys,
            "values": layer.values,
            "queries": layer.queries[:, -KVPRESS_WINDOW:].contiguous(),
            "o_proj": layer.o_proj,
            "layer_idx": layer.layer_idx,
            "num_layers": layer.num_layers,
        }
        if prerope:
            n = layer.num_tokens
            if layer.queries.shape[1] != n or layer.rope_inv_freq is None:
                raise ValueError("Expected Attention presses need every prompt query and RoPE frequencies")
            positions = torch.arange(n, device=layer.queries.device)
            entry["prerope_queries"] = unrotate(layer.queries.float(), positions, layer.rope_inv_freq)
            entry["inv_freq"] = layer.rope_inv_freq.float()
        entries.append(entry)
    torch.save({"layers": entries}, path)


def start_kvpress(
    work: Path,
    cases: list[Path],
    fractions: list[float],
    ref_python: Path,
    presses: tuple[str, ...] = KVPRESS_PRESSES,
) -> subprocess.Popen:
    jobs = [
        {"key": f"{press}@{fraction}", "press": press, "compression_ratio": 1.0 - fraction, "params": {}}
        for press in presses
        for fraction in fractions
    ]
    jobs_path = work / "jobs.json"
    jobs_path.write_text(json.dumps(jobs))
    command = [str(ref_python), str(KVPRESS_SCRIPT), "--jobs", str(jobs_path), "--out-dir", str(work)]
    return subprocess.Popen([*command, *map(str, cases)], stdout=subprocess.DEVNULL)


def our_rows(layers: list[LayerKV], methods: list[str], fractions: list[float]) -> list[dict]:
    rows = []
    n = layers[0].num_tokens
    with reused_scores():
        for method in methods:
            policy = build_policy(method)
            for fraction in fractions:
                budget = kvpress_kept_count(n, fraction)
                row = {"side": "ours", "method": method, "kept_fraction": fraction, "budget": budget}
                try:
                    row["kept"] = kept_per_layer(policy, layers, budget)
                except ValueError as error:
                    row["error"] = str(error)
                rows.append(row)
    return rows


def kvpress_rows(
    result_path: Path, fractions: list[float], presses: tuple[str, ...] = KVPRESS_PRESSES
) -> list[dict]:
    masks = torch.load(result_path, weights_only=True)
    rows = []
    for press in presses:
        for fraction in fractions:
            mask = masks[f"{press}@{fraction}"]
            kept = [KeptTokens.from_mask(layer_mask) for layer_mask in mask]
            rows.append({"side": "kvpress", "method": press, "kept_fraction": fraction, "kept": kept})
    return rows


def decode_in_batches(
    model,
    prompt: PrefilledPrompt,
    kept_rows: list,
    max_new_tokens: int,
    context_len: int,
    stops: list[int],
    finished,
    batch_bytes: float,
) -> list[torch.Tensor]:
    """Greedy token ids [T_r] for each kept set of ``kept_rows``, decoded several per batch, the batch sized
    so its KV entries (the first ``context_len`` tokens of every layer) stay under ``batch_bytes``."""
    per_row = sum(k.numel() * k.element_size() * 2 for k in prompt.keys) * context_len / prompt.num_tokens
    batch = max(1, int(batch_bytes // per_row))
    tokens = []
    for start in range(0, len(kept_rows), batch):
        outputs = decode_batch_with_kept(
            model, prompt, kept_rows[start : start + batch], max_new_tokens, context_len, stops, finished
        )
        tokens += [row_tokens for row_tokens, _ in outputs]
    return tokens


def decode_rows(
    model,
    tokenizer,
    prompt: PrefilledPrompt,
    rows: list[dict],
    context_len: int,
    answer: str,
    batch_bytes: float,
):
    """Fill ``answer_text``/``correct`` of every row that has a kept set, in memory-bounded batches."""
    runnable = [row for row in rows if "kept" in row]
    finished = answer_decided(answer, tokenizer)
    stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    kept_rows = [row["kept"] for row in runnable]
    outputs = decode_in_batches(
        model, prompt, kept_rows, MAX_NEW_TOKENS, context_len, stops, finished, batch_bytes
    )
    for row, tokens in zip(runnable, outputs, strict=True):
        row["answer_text"] = tokenizer.decode(tokens, skip_special_tokens=True)
        row["correct"] = is_correct(row["answer_text"], answer)


def run_prompt(model, tokenizer, sample: NeedlePrompt, args, work: Path) -> list[dict]:
    started = time.time()
    prompt = prefill(model, torch.tensor(sample.input_ids), query_window=None)
    prefill_s = time.time() - started
    n = prompt.num_tokens
    mode_layers = {
        "question-aware": (prompt.layers, n),
        "question-agnostic": (context_layers(prompt, sample.context_len, None), sample.context_len),
    }
    kvpress = None
    if not args.no_kvpress:
        cases = []
        for mode, (layers, _) in mode_layers.items():
            path = work / f"{sample.length}-{sample.sample}-{mode}.pt"
            write_kvpress_case(path, layers)
            cases.append(path)
        kvpress = start_kvpress(work, cases, args.fractions, args.ref_python)
    records = []
    for mode, (layers, context_len) in mode_layers.items():
        rows = [
            {
                "side": "full",
                "method": "full-cache",
                "kept_fraction": 1.0,
                "kept": [KeptTokens.everything(layer.num_kv_heads, context_len) for layer in layers],
            }
        ]
        rows += our_rows(layers, args.methods, args.fractions)
        if kvpress is not None:
            if kvpress.wait() != 0:
                raise RuntimeError(f"kvpress reference script failed with exit code {kvpress.returncode}")
            result = work / f"{sample.length}-{sample.sample}-{mode}.kvpress.pt"
            rows += kvpress_rows(result, args.fractions)
        decode_rows(model, tokenizer, prompt, rows, context_len, sample.answer, args.batch_bytes)
        for row in rows:
            kept = row.pop("kept", None)
            record = {
                "length": sample.length,
                "sample": sample.sample,
                "num_tokens": n,
                "context_len": sample.context_len,
                "needle_depth": round(sample.needle_depth, 3),
                "mode": mode,
                **row,
            }
            if kept is not None:
                record["kept_tokens"] = sum(k.total for k in kept)
                record["cache_tokens"] = sum(k.counts.numel() for k in kept) * context_len
            records.append(record)
    for path in work.glob(f"{sample.length}-{sample.sample}-*.pt"):
        path.unlink()
    print(
        f"length {sample.length} sample {sample.sample}: n={n}, prefill {prefill_s:.0f}s, "
        f"total {time.time() - started:.0f}s",
        flush=True,
    )
    return records


def done_prompts(out: Path) -> set[tuple[int, int]]:
    if not out.exists():
        return set()
    return {(r["length"], r["sample"]) for r in map(json.loads, out.read_text().splitlines()) if r}


def main() -> None:
    parser = argparse.ArgumentParser(description="Needle retrieval per eviction method and kept fraction")
    parser.add_argument("--model-dir", type=Path, default=None, help="default: the prepared bundled model")
    parser.add_argument("--lengths", default="1024,2048,4096,7168")
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--fractions", default="0.5,0.25,0.1")
    parser.add_argument("--methods", default=",".join(method_names()))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "policy_quality" / "results.jsonl")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/kvevict-policy-quality"))
    parser.add_argument("--ref-python", type=Path, default=ROOT / ".venv-ref" / "bin" / "python")
    parser.add_argument("--no-kvpress", action="store_true")
    parser.add_argument("--batch-bytes", type=float, default=1e9, help="KV cache bytes per decode batch")
    args = parser.parse_args()
    args.fractions = [float(x) for x in args.fractions.split(",")]
    args.methods = args.methods.split(",")
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.model_dir is None:
        from vllm_kvevict.cli.prepare_model import prepared_model_dir

        args.model_dir = prepared_model_dir()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    model, tokenizer = load_reference_model(args.model_dir)
    machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"
    print(f"model {args.model_dir}, {machine}", flush=True)
    done = done_prompts(args.out)
    # Samples outermost: every length gets a first sample before any gets a second.
    for sample_idx in range(args.samples):
        for length in lengths:
            if (length, sample_idx) in done:
                continue
            sample = needle_prompt(tokenizer, length, sample_idx, args.seed)
            records = run_prompt(model, tokenizer, sample, args, args.work_dir)
            with args.out.open("a") as out:
                for record in records:
                    out.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
