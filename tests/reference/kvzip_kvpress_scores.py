"""Runs in kvpress 0.5.5's environment (``.venv-ref``): KVzipPress on one prompt of a model, its scores and
kept entries saved for ``test_kvzip_parity.py``.

    .venv-ref/bin/python tests/reference/kvzip_kvpress_scores.py CASE.pt OUT.pt

CASE.pt: {"model_dir", "input_ids" [n], "jobs": [{"key", "compression_ratio", "chunk_size", "plus"}]};
OUT.pt: {key: {"scores": [layers, kv_heads, n] float32 (before sinks are raised), "kept": bool, same shape}}.
"""

from __future__ import annotations

import sys

import torch
from kvpress import KVzipPress
from transformers import AutoModelForCausalLM, DynamicCache


class ScoreKeepingKVzip(KVzipPress):
    """KVzipPress that keeps a copy of its scores before ``compress_post`` raises the sinks'."""

    def compress_post(self, model):
        self.kept_scores = self.score_val.float().clone()
        super().compress_post(model)


def kept_mask(model, shape: tuple[int, ...]) -> torch.Tensor:
    kept = torch.ones(shape, dtype=torch.bool)
    for idx, layer in enumerate(model.model.layers):
        _, heads, tokens = layer.self_attn.masked_key_indices
        kept[idx, heads, tokens] = False
        del layer.self_attn.masked_key_indices
    return kept


def main(case_path: str, out_path: str) -> None:
    case = torch.load(case_path, weights_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        case["model_dir"], dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    ids = case["input_ids"].reshape(1, -1)
    out = {}
    for job in case["jobs"]:
        press = ScoreKeepingKVzip(
            compression_ratio=job["compression_ratio"],
            chunk_size=job["chunk_size"],
            kvzip_plus_normalization=job["plus"],
        )
        with torch.no_grad(), press(model):
            model(input_ids=ids, past_key_values=DynamicCache())
        scores = press.kept_scores[:, 0]
        out[job["key"]] = {"scores": scores, "kept": kept_mask(model, tuple(scores.shape))}
    torch.save(out, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
