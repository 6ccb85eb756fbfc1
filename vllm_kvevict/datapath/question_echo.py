"""The question echo in the server (docs/question_first.md, issue 32): a prompt's eviction judged by its own
last window *and* by the queries of the tokens where a question placed before the document sits, run again
after the whole prompt.

A question-first prompt (instruction, then the document) has document text in its last window, so SnapKV's
window does not point at what the question needs. The echo finds the question where it can be
(``question_spans``): the first ``width`` tokens of the last user turn (after the chat template's user
header); with them the system message's last ``width`` when the application wrote its own system message
before one user turn; in a prompt with no user header (a plain completion), its first ``width`` tokens. They
run once more at positions ``P ..`` with the whole prompt in view, so that in every layer their queries have
read the document as a question placed last would have. Those queries join the prompt's own last window,
and the method keeps what both attend to (and its own window, as always).

In the server the echo runs after the step's forward that completes the prompt (whose first output token
comes from the real prompt, unchanged): the request's compaction is deferred from that forward to the echo
pass, which attends each layer to the held entries read back from the cache without writing them, then
compacts that layer as the last chunk does (``echo_pass.EchoPass``, ``ChunkEviction``). A prompt whose method
reads no query window is evicted as before.

With ``echo_between_chunks`` (off by default), a prompt evicted between chunks (``prefill: chunked``) is
echoed after every evicting chunk too, at the positions right after the tokens computed so far: there the
echo is those spans *and* the prompt's last ``width`` (``between_echo_tokens``;
all of a prompt's token ids are known when it arrives, so a question placed last is echoed before its chunk
is computed), and the between-chunks rule's window part judges with their queries beside the chunk's own
last window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from vllm_kvevict.datapath.chat_marks import ChatMarks
from vllm_kvevict.datapath.chunk_rescore import ChunkRescore
from vllm_kvevict.policies.base import EvictionPolicy


def user_turn_start(token_ids: Sequence[int] | np.ndarray, header: Sequence[int]) -> int | None:
    """Index of the first token after the last occurrence of ``header`` (the chat template's user header),
    or None when the prompt has none."""
    starts = _header_ends(token_ids, header)
    return starts[-1] if starts else None


def _header_ends(token_ids: Sequence[int] | np.ndarray, header: Sequence[int]) -> list[int]:
    """The index right after each occurrence of ``header`` in ``token_ids``, in order."""
    ids = np.asarray(token_ids)
    size = len(header)
    if size == 0 or ids.shape[0] < size:
        return []
    head = np.asarray(header, dtype=ids.dtype)
    candidates = np.flatnonzero(ids[: ids.shape[0] - size + 1] == head[0])
    return [int(s) + size for s in candidates.tolist() if np.array_equal(ids[s : s + size], head)]


def question_spans(
    token_ids: Sequence[int] | np.ndarray, marks: ChatMarks, width: int
) -> list[tuple[int, int]]:
    """Where the question can sit before the prompt's end, as ``[start, end)`` spans of ``width`` tokens at
    most, in order: the last user turn's first ``width`` tokens, preceded by the system message's last
    ``width`` when the prompt is a system message of its own and one user turn (the question pinned in the
    system message, a document as the user turn); without a user header (a plain completion prompt), the
    prompt's first ``width`` tokens after its BOS ("Question: ... Context: ..."). Empty for an empty
    prompt."""
    n = len(token_ids)
    header = marks.user_header
    ends = _header_ends(token_ids, header)
    if not ends:
        first = 1 if marks.bos is not None and n and int(token_ids[0]) == marks.bos else 0
        return [(first, min(n, first + width))] if n > first else []
    start = ends[-1]
    spans = [(start, min(n, start + width))]
    system_end = start - len(header)
    if len(ends) == 1 and system_end > 0 and not _is_default(token_ids, system_end, marks.default_preamble):
        spans.insert(0, (max(0, system_end - width), system_end))
    return spans


def _is_default(token_ids: Sequence[int] | np.ndarray, end: int, default: tuple[int, ...] | None) -> bool:
    """True when ``token_ids[:end]`` is the template's default system message ``default`` (lengths first:
    an own system message may be long, and this runs once per echoed prompt)."""
    if default is None or end != len(default):
        return False
    return bool(np.array_equal(np.asarray(token_ids[:end]), default))


def _tokens_of(token_ids: Sequence[int] | np.ndarray, spans: list[tuple[int, int]]) -> list[int]:
    """The tokens of ``spans`` (sorted), each token once where spans overlap."""
    ids = np.asarray(token_ids)
    merged: list[list[int]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        elif end > start:
            merged.append([start, end])
    return [int(t) for start, end in merged for t in ids[start:end]]


def echo_tokens(token_ids: Sequence[int] | np.ndarray, marks: ChatMarks, width: int) -> list[int]:
    """The echo of a prompt: the tokens of its ``question_spans``."""
    return _tokens_of(token_ids, question_spans(token_ids, marks, width))


def between_echo_tokens(token_ids: Sequence[int] | np.ndarray, marks: ChatMarks, width: int) -> list[int]:
    """The echo after an earlier chunk of a prompt: its ``question_spans``, then the prompt's last ``width``
    tokens (where a question placed last sits; each token once where they overlap)."""
    n = len(token_ids)
    spans = question_spans(token_ids, marks, width)
    return _tokens_of(token_ids, [*spans, (max(0, n - width), n)]) if spans else []


def echo_policy(policy: EvictionPolicy, width: int) -> EvictionPolicy | None:
    """``policy`` judged by its own window and ``width`` echo queries after the prompt (it keeps its own
    window only: the echo tokens are no prompt tokens), or None for a method that reads no bounded window of
    trailing queries (StreamingLLM, K-norm, KeyDiff, H2O, Expected Attention)."""
    large = 1 << 20
    if not 0 < policy.query_window(large) < large:
        return None
    echoed = _with_echo(policy, width)
    if echoed is not None:
        echoed.name = policy.name  # set by the registry, not a field: metrics and logs name the method
    return echoed


def _with_echo(policy: EvictionPolicy, width: int) -> EvictionPolicy | None:
    if hasattr(policy, "with_echo_queries"):  # the window's owner (SnapKV and its subclasses, NaCl)
        return policy.with_echo_queries(width)
    names = {f.name for f in dataclasses.fields(policy)} if dataclasses.is_dataclass(policy) else set()
    if "inner" in names:  # a wrapper (Ada-KV, CriticalKV) around the window's owner
        inner = _with_echo(policy.inner, width)  # type: ignore[attr-defined]
        return None if inner is None else dataclasses.replace(policy, inner=inner)  # type: ignore[type-var]
    return None


class QuestionEcho:
    """The served tokenizer's ``marks`` (``chat_marks.ChatMarks``), the server's echo ``width`` (a request
    may ask its own), whether prompts evicted chunk by chunk are echoed after every evicting chunk too
    (``between_chunks``), and each method's echo-reading copy (built once per policy object and width)."""

    def __init__(self, width: int, marks: ChatMarks, between_chunks: bool = False) -> None:
        self.width = width
        self.marks = marks
        self.between_chunks = between_chunks
        self._policies: dict[tuple[int, int], tuple[EvictionPolicy, EvictionPolicy | None]] = {}

    def tokens(self, prompt_token_ids: Sequence[int] | np.ndarray, width: int) -> list[int]:
        """The echo of one prompt (``echo_tokens``; empty for an empty prompt)."""
        return echo_tokens(prompt_token_ids, self.marks, width)

    def between_tokens(self, prompt_token_ids: Sequence[int] | np.ndarray, width: int) -> list[int]:
        """The echo of one prompt after one of its earlier chunks (``between_echo_tokens``)."""
        return between_echo_tokens(prompt_token_ids, self.marks, width)

    def policy_for(self, policy: EvictionPolicy, width: int) -> EvictionPolicy | None:
        """``policy`` reading ``width`` echo queries, or None when the method reads no bounded window."""
        key = (id(policy), width)
        cached = self._policies.get(key)
        if cached is None or cached[0] is not policy:
            cached = (policy, echo_policy(policy, width))
            self._policies[key] = cached
        return cached[1]


@dataclass(frozen=True)
class EchoLayer:
    """One attention layer's tensors in the echo forward: query/output [N, Hq, D], key/value [N, H, D]
    (post-RoPE, the echo tokens of every request in order), the softmax scale and the logits soft cap."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    output: torch.Tensor
    scale: float
    softcap: float | None = None


@dataclass
class EchoRequest:
    """A request compacted by the echo pass in this step: ``rescore`` is its deferred re-score
    (``rescore.deferred``: its prompt's last chunk, or an earlier chunk that evicts), ``tokens`` its echo,
    run at positions ``rescore.seq_len ..`` (right after the tokens computed so far), rows
    ``[row, row + len(tokens))`` of the echo batch; ``policy`` the method reading the echo's queries beside
    its window (between chunks, the between-chunks rule is built around it)."""

    rescore: ChunkRescore
    tokens: list[int]
    policy: EvictionPolicy
    row: int = 0

    @property
    def width(self) -> int:
        return len(self.tokens)
