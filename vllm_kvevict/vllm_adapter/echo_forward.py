"""The question echo's side of vLLM (``datapath/question_echo.py``): the served tokenizer's chat marks, and
the echo forward, run by the ``execute_model`` hook after the step's own forward.

The echo forward calls the runner's model on the echo tokens under a forward context of its own: every
attention layer gets ``EchoMetadata`` (the evicting impl then attends the echo to the prompt's held entries
and compacts the layer, ``EvictingImpl.forward``) and no slot mapping, so vLLM's cache update writes nothing.
The model's hidden states are dropped: the step's output tokens came from its own forward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.forward_context import set_forward_context
from vllm.logger import init_logger

from vllm_kvevict.datapath.chat_marks import ChatMarks, chat_marks
from vllm_kvevict.datapath.step import EvictionStep

logger = init_logger("vllm.kvevict.echo")


@dataclass(frozen=True)
class EchoMetadata:
    """Every attention layer's metadata during the echo forward: the step whose echo pass runs."""

    echo_step: EvictionStep


def load_chat_marks(vllm_config: Any) -> ChatMarks:
    """The question echo's marks of the served model's tokenizer (``datapath/chat_marks.py``); empty marks
    when the worker cannot load it (every prompt is then echoed by its head)."""
    from vllm.tokenizers import cached_tokenizer_from_config

    try:
        tokenizer = cached_tokenizer_from_config(vllm_config.model_config)
    except Exception as exc:
        logger.warning("kv eviction question echo: the tokenizer did not load in the worker (%s)", exc)
        return ChatMarks()
    marks = chat_marks(tokenizer)
    logger.info(
        "kv eviction question echo: user header %s, default system message %s, BOS %s",
        list(marks.user_header) or "none (every prompt echoed by its head)",
        "none" if marks.default_preamble is None else f"{len(marks.default_preamble)} tokens",
        marks.bos,
    )
    return marks


def run_echo(runner: Any, step: EvictionStep) -> None:
    """Run the step's echo forward on the runner's model (compacting the echoed prompts layer by layer)."""
    echo = step.echo
    assert echo is not None
    device = runner.device
    layers = runner.vllm_config.compilation_config.static_forward_context
    metadata = EchoMetadata(step)
    # skip_compiled (vLLM 0.32's ``ForwardContext.skip_compiled``, read by ``support_torch_compile``'s
    # ``__call__``): the echo calls the model's own forward, not the graph vLLM compiled for its steps.
    # Through that graph (compiled servers, vLLM's default) the echo tokens' layer-0 keys and values came
    # out wrong (key norm 126.1 against HF's 106.3 for the same 32 tokens; eager 106.4), so the echo
    # judged by other queries than its tokens'.
    with set_forward_context(
        {name: metadata for name in layers},
        runner.vllm_config,
        num_tokens=echo.num_tokens,
        slot_mapping={},
        skip_compiled=True,
    ):
        runner.model(
            input_ids=echo.input_ids(device),
            positions=echo.positions(device),
            intermediate_tensors=None,
            inputs_embeds=None,
        )
