"""The question echo's side of vLLM (``datapath/question_echo.py``): the chat template's user header as token
ids, and the echo forward, run by the ``execute_model`` hook after the step's own forward.

The echo forward calls the runner's model on the echo tokens under a forward context of its own: every
attention layer gets ``EchoMetadata`` (the evicting impl then attends the echo to the prompt's held entries
and compacts the layer, ``EvictingImpl.forward``) and no slot mapping, so vLLM's cache update writes nothing.
The model's hidden states are dropped: the step's output tokens came from its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from vllm_kvevict.datapath.step import EvictionStep

logger = init_logger("vllm.kvevict.echo")

_MARK = "\x00kvevict-echo-mark\x00"


@dataclass(frozen=True)
class EchoMetadata:
    """Every attention layer's metadata during the echo forward: the step whose echo pass runs."""

    echo_step: EvictionStep


def user_header_ids(tokenizer: Any) -> list[int] | None:
    """Token ids of the chat template's header of a user turn that follows another turn (``<|im_end|>\\n
    <|im_start|>user\\n`` in ChatML): the text two renderings share right before a user turn's content (after
    a system turn and after an assistant turn). None without a chat template or a common header."""
    try:
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
        logger.warning("kv eviction question echo off: the chat template gives no user turn (%s)", exc)
        return None
    after_system = first[first.index("S") + 1 : first.index(_MARK)]
    after_assistant = later[later.rindex("A", 0, later.index(_MARK)) + 1 : later.index(_MARK)]
    size = 0
    longest = min(len(after_system), len(after_assistant))
    while size < longest and after_system[-1 - size] == after_assistant[-1 - size]:
        size += 1
    header = after_system[len(after_system) - size :]
    ids = tokenizer.encode(header, add_special_tokens=False) if header.strip() else []
    return list(ids) or None


def load_user_header(vllm_config: Any) -> list[int] | None:
    """The user header of the served model's tokenizer (None when it has no chat template with one)."""
    from vllm.tokenizers import cached_tokenizer_from_config

    try:
        tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
    except Exception as exc:  # the worker cannot load it: prompts are judged by their last window alone
        logger.warning("kv eviction question echo off: the tokenizer did not load in the worker (%s)", exc)
        return None
    header = user_header_ids(tokenizer)
    if header is None:
        logger.warning("kv eviction question echo off: no user header in the chat template")
    else:
        logger.info("kv eviction question echo: user header %s", header)
    return header


@torch.inference_mode()
def run_echo(runner: Any, step: EvictionStep) -> None:
    """Run the step's echo forward on the runner's model (compacting the echoed prompts layer by layer)."""
    echo = step.echo
    assert echo is not None
    device = runner.device
    layers = runner.vllm_config.compilation_config.static_forward_context
    metadata = EchoMetadata(step)
    with set_forward_context(
        {name: metadata for name in layers}, runner.vllm_config, num_tokens=echo.num_tokens, slot_mapping={}
    ):
        runner.model(
            input_ids=echo.input_ids(device),
            positions=echo.positions(device),
            intermediate_tensors=None,
            inputs_embeds=None,
        )
