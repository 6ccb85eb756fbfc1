"""The question probe (issue 32 item 3), in the reference runner: a few of the prompt's own tokens run as a
short side sequence, without the rest of the prompt, at the positions right after the prompt's end; their
per-layer queries then judge the prompt's keys as SnapKV's last window would. ``echo_queries`` runs such
tokens with the whole prompt's cache in view instead (an echo of the question after the document).

Which tokens: ``probe_tokens`` takes the spans where a question placed first sits (the server's rule,
``datapath.question_echo.question_spans``: the first ``width`` tokens of the last user turn, the system
message's last ``width`` when the prompt has its own, a plain completion's first ``width``) and the prompt's
last ``width`` tokens (where a question-last prompt puts it), so the probe finds the question at either end
without knowing which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from vllm_kvevict.datapath.chat_marks import chat_marks
from vllm_kvevict.datapath.question_echo import between_echo_tokens, echo_tokens
from vllm_kvevict.hf_reference.capture import PrefilledPrompt, recording
from vllm_kvevict.hf_reference.generation import cache_prefix
from vllm_kvevict.policies.base import LayerKV


def probe_tokens(token_ids: Sequence[int], tokenizer: PreTrainedTokenizerBase, width: int) -> list[int]:
    """The probe: where a question placed before the document sits (the server's rule,
    ``question_echo.question_spans``), then the prompt's last ``width`` (each token once where they
    overlap)."""
    return between_echo_tokens(token_ids, chat_marks(tokenizer), width)


def head_tokens(token_ids: Sequence[int], tokenizer: PreTrainedTokenizerBase, width: int) -> list[int]:
    """The echo's tokens, as the server picks them (``question_echo.echo_tokens``): the last user turn's first
    ``width``, with the system message's last ``width`` before them when the prompt has its own; without a
    user header the prompt's first ``width``."""
    return echo_tokens(token_ids, chat_marks(tokenizer), width)


@torch.inference_mode()
def probe_queries(model: PreTrainedModel, probe: list[int], first_position: int) -> list[torch.Tensor]:
    """Per layer [q_heads, w, d] float32 post-RoPE queries of ``probe`` run alone (no cache, no context) at
    positions ``first_position`` .. ``first_position + w - 1``."""
    ids = torch.tensor([probe], device=model.device)
    positions = torch.arange(first_position, first_position + len(probe), device=model.device)[None]
    with recording(model, None) as recorders:
        model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1)
    return [recorder.queries for recorder in recorders]


@torch.inference_mode()
def echo_queries(model: PreTrainedModel, prompt: PrefilledPrompt, tokens: list[int]) -> list[torch.Tensor]:
    """Per layer [q_heads, w, d] float32 post-RoPE queries of ``tokens`` run again right after the whole
    prompt, its full cache in view (an echo: unlike ``probe_queries``, every layer's queries have read the
    context), at positions ``n`` .. ``n + w - 1``. The prompt's cache is copied, not changed."""
    cache = cache_prefix(model, prompt)
    n = prompt.num_tokens
    ids = torch.tensor([tokens], device=model.device)
    positions = torch.arange(n, n + len(tokens), device=model.device)[None]
    with recording(model, None) as recorders:
        model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return [recorder.queries for recorder in recorders]


def probed_layers(layers: list[LayerKV], queries: list[torch.Tensor], window: int = 0) -> list[LayerKV]:
    """``layers`` judged by the probe's queries (placed after the prompt: every key is visible to them), after
    the prompt's own last ``window`` queries when ``window`` > 0 (``layers`` must hold them)."""
    probed = []
    for layer, probe in zip(layers, queries, strict=True):
        n, given = layer.num_tokens, layer.queries.shape[1]
        own = layer.queries[:, given - window :] if window else layer.queries[:, :0]
        own_positions = layer.positions()[given - window :].cpu() if window else torch.arange(0)
        positions = torch.cat([own_positions, torch.arange(n, n + probe.shape[1])])
        probed.append(replace(layer, queries=torch.cat([own, probe], dim=1), query_positions=positions))
    return probed
