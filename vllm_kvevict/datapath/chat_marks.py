"""Where a prompt's question can sit, as token ids of the served tokenizer (the question echo's marks,
``datapath/question_echo.py``): the chat template's user header, what the template writes before a lone user
turn (its default system message), and the BOS token a plain completion prompt starts with.

Read once from the tokenizer at start-up (the server) or per tokenizer (the HF runner); vLLM-free.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("vllm.kvevict.echo")

_MARK = "\x00kvevict-echo-mark\x00"


@dataclass(frozen=True)
class ChatMarks:
    """``user_header``: the header of a user turn that follows another turn
    (``<|im_end|>\\n<|im_start|>user\\n`` in ChatML; empty without a chat template);
    ``default_preamble``: the tokens before that header when the prompt is one user turn and nothing else (the
    template's default system message; None when the template puts no such header before a lone user
    turn); ``bos``: the token a completion prompt starts with (None: the tokenizer adds none)."""

    user_header: tuple[int, ...] = ()
    default_preamble: tuple[int, ...] | None = None
    bos: int | None = None


def chat_marks(tokenizer: Any) -> ChatMarks:
    """The marks of ``tokenizer`` (a Hugging Face tokenizer). A template that refuses the probing turns, or
    none, gives no user header: every prompt is then echoed by its head (``question_echo.question_spans``)."""
    try:
        return _cached_marks(tokenizer)
    except TypeError:  # an unhashable tokenizer wrapper: read it again
        return _cached_marks.__wrapped__(tokenizer)


@functools.lru_cache(maxsize=8)
def _cached_marks(tokenizer: Any) -> ChatMarks:
    bos = _leading_bos(tokenizer)
    try:
        lone = tokenizer.apply_chat_template([{"role": "user", "content": _MARK}], tokenize=False)
        first = tokenizer.apply_chat_template(
            [{"role": "system", "content": "S"}, {"role": "user", "content": _MARK}], tokenize=False
        )
        later = tokenizer.apply_chat_template(
            [
                {"role": "system", "content": "S"},
                {"role": "user", "content": "U"},
                {"role": "assistant", "content": "A"},
                {"role": "user", "content": _MARK},
            ],
            tokenize=False,
        )
    except Exception as exc:  # no chat template, or one that refuses these turns
        logger.warning("kv eviction question echo: the chat template gives no user turn (%s)", exc)
        return ChatMarks(bos=bos)
    after_system = first[first.index("S") + 1 : first.index(_MARK)]
    after_assistant = later[later.rindex("A", 0, later.index(_MARK)) + 1 : later.index(_MARK)]
    size = 0
    longest = min(len(after_system), len(after_assistant))
    while size < longest and after_system[-1 - size] == after_assistant[-1 - size]:
        size += 1
    header = after_system[len(after_system) - size :]
    header_ids = _encode(tokenizer, header) if header.strip() else []
    if not header_ids:
        return ChatMarks(bos=bos)
    before_lone = lone[: lone.index(_MARK)]
    preamble = None
    if before_lone.endswith(header):
        preamble = tuple(_encode(tokenizer, before_lone[: len(before_lone) - len(header)]))
    return ChatMarks(tuple(header_ids), preamble, bos)


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _leading_bos(tokenizer: Any) -> int | None:
    """The token the tokenizer puts first in an encoded text of its own, if it puts one."""
    ids = list(tokenizer.encode("x", add_special_tokens=True))
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if ids and bos is not None and ids[0] == bos else None
