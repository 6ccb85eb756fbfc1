"""Kept token sets of kvpress 0.5.5 presses on given tensors. Run with ``.venv-ref/bin/python``.

Imports only kvpress, transformers and torch (no vllm_kvevict): the main environment writes the inputs, this
script writes kvpress's answer, both as ``torch.save`` files.

Input case file (``torch.save``): ``{"layers": [{"keys": [kv_heads, n, d], "values": [kv_heads, n, d],
"queries": [q_heads, w, d] post-RoPE queries of the last w prompt positions, "o_proj": [hidden, q_heads*d],
"layer_idx": int, "num_layers": int}, ...]}``, float32; for the Expected Attention presses also
"prerope_queries": [q_heads, n, d] (every position's query before RoPE) and "inv_freq": [d / 2].
Jobs (a JSON file, or a ``"jobs"`` entry of the case itself, which wins): ``[{"key": str, "press": one of
PRESSES, "compression_ratio": float, "params": {...}}]``, params being kvpress's own field names.
Output (``torch.save``, one per case, ``<out_dir>/<case stem>.kvpress.pt``): ``{key: kept bool
[num_layers, kv_heads, n]}``.

How the press sees our tensors: kvpress recomputes window queries from hidden states
(``q_proj(hidden_states[:, -window:])`` then RoPE with ``position_embeddings``). We hand it a module whose
q_proj is the identity and position embeddings cos = 1, sin = 0, and hidden states whose last w rows are
the given post-RoPE queries: kvpress then computes on exactly our queries (multiplying by 1 and adding 0
are exact). Expected Attention instead reads every position's pre-RoPE query (hidden states = the given
"prerope_queries", identity q_proj) and RoPE's frequencies for its averaged future rotation
(``module.rotary_emb``, HF Llama's arithmetic on the given "inv_freq"); a case holding them is for the
Expected Attention presses only. Kept sets: ScorerPress.compress gathers the kept keys, which are matched
back to their positions (every key row of a head is distinct); AdaKV/CriticalAdaKV record their evicted
entries in ``module.masked_key_indices``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from kvpress import (
    AdaKVPress,
    CriticalAdaKVPress,
    CriticalKVPress,
    ExpectedAttentionPress,
    KeyDiffPress,
    KnormPress,
    PyramidKVPress,
    SnapKVPress,
    StreamingLLMPress,
)
from torch import nn

PRESSES = tuple(
    "snapkv pyramidkv ada-snapkv critical-snapkv critical-ada-snapkv streamingllm keydiff knorm "
    "expected-attention ada-expected-attention".split()
)
#: ExpectedAttentionPress's own field names.
EXPECTED_FIELDS = ("n_future_positions", "n_sink", "use_covariance", "use_vnorm", "epsilon")


def build_press(name: str, compression_ratio: float, params: dict):
    """A kvpress press for one of our method names; ``params`` are kvpress's own field names."""
    snap_fields = {k: params[k] for k in ("window_size", "kernel_size") if k in params}
    if name == "snapkv":
        return SnapKVPress(compression_ratio=compression_ratio, **snap_fields)
    if name == "pyramidkv":
        beta = {"beta": params["beta"]} if "beta" in params else {}
        return PyramidKVPress(compression_ratio=compression_ratio, **snap_fields, **beta)
    if name == "ada-snapkv":
        alpha = {k: params[k] for k in ("alpha_safeguard",) if k in params}
        return AdaKVPress(SnapKVPress(compression_ratio=compression_ratio, **snap_fields), **alpha)
    if name == "critical-snapkv":
        crit = {k: params[k] for k in ("epsilon", "first_stage_ratio") if k in params}
        return CriticalKVPress(SnapKVPress(compression_ratio=compression_ratio, **snap_fields), **crit)
    if name == "critical-ada-snapkv":
        rest = {k: params[k] for k in ("alpha_safeguard", "epsilon", "first_stage_ratio") if k in params}
        return CriticalAdaKVPress(SnapKVPress(compression_ratio=compression_ratio, **snap_fields), **rest)
    if name == "streamingllm":
        sinks = {"n_sink": params["n_sink"]} if "n_sink" in params else {}
        return StreamingLLMPress(compression_ratio=compression_ratio, **sinks)
    if name == "keydiff":
        return KeyDiffPress(compression_ratio=compression_ratio)
    if name == "knorm":
        return KnormPress(compression_ratio=compression_ratio)
    if name in ("expected-attention", "ada-expected-attention"):
        fields = {k: params[k] for k in EXPECTED_FIELDS if k in params}
        press = ExpectedAttentionPress(compression_ratio=compression_ratio, **fields)
        if name == "expected-attention":
            return press
        alpha = {k: params[k] for k in ("alpha_safeguard",) if k in params}
        return AdaKVPress(press, **alpha)
    raise ValueError(f"unknown press {name!r}; choose one of {', '.join(PRESSES)}")


class ReplayRotary(nn.Module):
    """HF Llama's rotary embedding (default RoPE) on given inverse frequencies: (cos, sin) [1, t, d]."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        super().__init__()
        self.inv_freq = inv_freq.float()

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        freqs = (inv_freq @ position_ids[:, None, :].float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class ReplayAttention(nn.Module):
    """The attributes of a Llama attention layer that the presses read, around given tensors."""

    def __init__(
        self,
        q_heads: int,
        kv_heads: int,
        head_dim: int,
        o_proj: torch.Tensor,
        layer_idx: int,
        num_layers: int,
    ) -> None:
        super().__init__()
        hidden = o_proj.shape[0]
        self.config = SimpleNamespace(
            num_attention_heads=q_heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            _attn_implementation="sdpa",
        )
        self.head_dim = head_dim
        self.layer_idx = layer_idx
        self.num_key_value_groups = q_heads // kv_heads
        # skip_init: the weights are overwritten at once, a random init would only cost time.
        self.q_proj = nn.utils.skip_init(nn.Linear, q_heads * head_dim, q_heads * head_dim, bias=False)
        self.o_proj = nn.utils.skip_init(nn.Linear, q_heads * head_dim, hidden, bias=False)
        with torch.no_grad():
            self.q_proj.weight.copy_(torch.eye(q_heads * head_dim))
            self.o_proj.weight.copy_(o_proj)


def row_fingerprints(rows: torch.Tensor) -> torch.Tensor:
    """[m] int64 hash of the exact bits of each float32 row of ``rows`` [m, d] (wrapping arithmetic)."""
    bits = rows.contiguous().view(torch.int32).to(torch.int64)
    generator = torch.Generator().manual_seed(1234)
    coefficients = torch.randint(1, 2**62, (rows.shape[1],), generator=generator) * 2 + 1
    return (bits * coefficients).sum(dim=1)


class RowIndex:
    """Finds the token index of key rows of one head: original [n, d]; every row must be distinct."""

    def __init__(self, original: torch.Tensor) -> None:
        prints = row_fingerprints(original)
        self.order = prints.argsort()
        self.sorted_prints = prints[self.order]
        if bool((self.sorted_prints[1:] == self.sorted_prints[:-1]).any()):
            raise ValueError("two key rows of a head are identical: kept sets are ambiguous")
        self.original = original

    def positions(self, kept: torch.Tensor) -> torch.Tensor:
        """[m] int64 token index of each row of kept [m, d]."""
        wanted = row_fingerprints(kept)
        where = torch.searchsorted(self.sorted_prints, wanted).clamp(max=len(self.order) - 1)
        if not bool((self.sorted_prints[where] == wanted).all()):
            raise ValueError("a kept key row is not among the original rows")
        positions = self.order[where]
        if not torch.equal(self.original[positions], kept):
            raise ValueError("kept key rows do not match the original rows they were traced to")
        return positions


class LayerReplay:
    """One layer as the presses see it: module, hidden states [1, n, q_heads*d], keys/values
    [1, kv_heads, n, d] and forward kwargs, built once and reused by every press."""

    def __init__(self, layer: dict) -> None:
        keys, values, queries = layer["keys"].float(), layer["values"].float(), layer["queries"].float()
        kv_heads, n, d = keys.shape
        q_heads, w, _ = queries.shape
        self.module = ReplayAttention(
            q_heads, kv_heads, d, layer["o_proj"].float(), layer["layer_idx"], layer["num_layers"]
        )
        self.hidden = torch.zeros(1, n, q_heads * d)
        self.hidden[0, n - w :] = queries.transpose(0, 1).reshape(w, q_heads * d)
        if "prerope_queries" in layer:  # Expected Attention: every position's query before RoPE
            self.hidden = layer["prerope_queries"].float().transpose(0, 1).reshape(1, n, q_heads * d)
            self.module.rotary_emb = ReplayRotary(layer["inv_freq"])
        self.keys, self.values = keys[None], values[None]
        self.kwargs = {"position_embeddings": (torch.ones(1, n, d), torch.zeros(1, n, d))}
        self.row_indices = [RowIndex(keys[h]) for h in range(kv_heads)]

    @torch.inference_mode()
    def kept_mask(self, press) -> torch.Tensor:
        """[kv_heads, n] bool: the tokens ``press`` keeps in this layer."""
        kv_heads, n = self.keys.shape[1], self.keys.shape[2]
        self.module.masked_key_indices = None
        new_keys, _ = press.compress(
            self.module, self.hidden, self.keys.clone(), self.values.clone(), None, self.kwargs
        )
        masked = self.module.masked_key_indices
        if masked is not None:
            _, heads, tokens = masked
            keep = torch.ones(kv_heads, n, dtype=torch.bool)
            keep[heads, tokens] = False
            return keep
        keep = torch.zeros(kv_heads, n, dtype=torch.bool)
        for h in range(kv_heads):
            keep[h, self.row_indices[h].positions(new_keys[0, h])] = True
        return keep


def run_case(case_path: Path, jobs: list[dict], out_dir: Path) -> Path:
    case = torch.load(case_path, weights_only=True)
    case_jobs = case.get("jobs", jobs)
    presses = [
        build_press(job["press"], job["compression_ratio"], job.get("params", {})) for job in case_jobs
    ]
    per_job: list[list[torch.Tensor]] = [[] for _ in case_jobs]
    for layer in case["layers"]:
        replay = LayerReplay(layer)
        for masks, press in zip(per_job, presses, strict=True):
            masks.append(replay.kept_mask(press))
    result = {job["key"]: torch.stack(masks) for job, masks in zip(case_jobs, per_job, strict=True)}
    out = out_dir / f"{case_path.stem}.kvpress.pt"
    torch.save(result, out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=Path, help="JSON list of presses to run (a case's own jobs win)")
    parser.add_argument("--out-dir", type=Path, required=True)
    parser.add_argument("cases", type=Path, nargs="+", help="case files written with torch.save")
    args = parser.parse_args()
    jobs = json.loads(args.jobs.read_text()) if args.jobs else []
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for case_path in args.cases:
        print(run_case(case_path, jobs, args.out_dir), flush=True)


if __name__ == "__main__":
    main()
