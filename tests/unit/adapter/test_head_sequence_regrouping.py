"""The evicting backend regroups the batch's query head-major for the head-as-sequence kernel call and puts
the result back where vLLM's impl would have written it (``EvictingImpl._head_sequence_attention``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_kvevict.vllm_adapter.evicting_backend import EvictingImpl  # noqa: E402

HEADS, GROUP, D = 3, 2, 4


class RecordingImpl(EvictingImpl):
    """The mixin's regrouping around a kernel that records its query and returns it negated."""

    num_kv_heads, num_queries_per_kv, head_size = HEADS, GROUP, D

    def __init__(self) -> None:  # no vLLM impl behind it: only the regrouping runs
        self.seen: torch.Tensor | None = None

    def head_attention(self, layer, step, batch, query, kv_cache, out) -> None:
        self.seen = query.clone()
        out.copy_(-query)

    def standard_attention(self, layer, part, query, kv_cache, out) -> None:
        self.standard_seen = query.clone()
        out.copy_(2 * query)


@pytest.mark.parametrize("flat_output", [False, True])
def test_sequence_h_of_the_kernel_reads_head_h_of_every_token_and_writes_back_in_place(flat_output):
    tokens, padded = 5, 7  # vLLM pads its tensors past the step's tokens
    query = torch.randn(padded, HEADS * GROUP, D)
    shape = (padded, HEADS * GROUP * D) if flat_output else (padded, HEADS * GROUP, D)
    output = torch.zeros(shape)
    impl = RecordingImpl()
    batch = SimpleNamespace(tokens=None)
    impl._head_sequence_attention(None, SimpleNamespace(num_tokens=tokens), batch, query, None, output)
    assert impl.seen is not None and impl.seen.shape == (HEADS * tokens, GROUP, D)
    for h in range(HEADS):
        for t in range(tokens):
            assert torch.equal(impl.seen[h * tokens + t], query[t, h * GROUP : (h + 1) * GROUP])
    assert torch.equal(output[:tokens].view(tokens, HEADS * GROUP, D), -query[:tokens])
    assert not output[tokens:].any()


def test_a_mixed_batch_runs_vllms_call_over_every_row_then_the_compacted_rows_head_major():
    """``split_batch``'s two parts: vLLM's call over the step's query as it is (every row, the compacted
    requests' as dummies), then the compacted requests' tokens (rows 0, 3, 4) regrouped head-major for the
    head-as-sequence call, whose results overwrite exactly those rows; padding rows stay untouched."""
    tokens = 5
    query = torch.randn(tokens + 2, HEADS * GROUP, D)
    output = torch.zeros(tokens + 2, HEADS * GROUP * D)
    impl = RecordingImpl()
    impl.num_heads = HEADS * GROUP
    step = SimpleNamespace(num_tokens=tokens)
    compacted, standard = torch.tensor([0, 3, 4]), torch.tensor([1, 2])
    impl._standard_attention(None, step, SimpleNamespace(), query, None, output)
    impl._head_sequence_attention(None, step, SimpleNamespace(tokens=compacted), query, None, output)
    assert torch.equal(impl.standard_seen, query[:tokens])
    assert impl.seen is not None and impl.seen.shape == (HEADS * 3, GROUP, D)
    for h in range(HEADS):
        for i, t in enumerate(compacted.tolist()):
            assert torch.equal(impl.seen[h * 3 + i], query[t, h * GROUP : (h + 1) * GROUP])
    result = output.view(tokens + 2, HEADS * GROUP, D)
    assert torch.equal(result[compacted], -query[compacted])
    assert torch.equal(result[standard], 2 * query[standard])
    assert not output[tokens:].any()
