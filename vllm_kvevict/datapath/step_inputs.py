"""What the model runner knows about one engine step (request ids, prompt lengths, token counts), and the
requests of the step as the datapath sees them."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from vllm_kvevict.layout.accounting import RequestPlan
from vllm_kvevict.policies.base import EvictionPolicy

if TYPE_CHECKING:
    from vllm_kvevict.datapath.decode_schedule import DecodeRecord


@dataclass(frozen=True)
class StepInputs:
    """What the model runner knows about this step's batch, in batch order (one entry per request)."""

    req_ids: list[str]
    prompt_lens: np.ndarray  # [R] prompt tokens
    computed: np.ndarray  # [R] tokens already in the cache before this step
    scheduled: np.ndarray  # [R] tokens computed in this step
    extra_args: list[dict | None] | None = None  # [R] SamplingParams.extra_args (per-request settings)
    #: slot -> the request's prompt token ids (read only for prompts the question echo may judge)
    prompt_token_ids: Callable[[int], Sequence[int]] | None = None
    #: [R] entries of each request's block-table row (None: unknown, no spare blocks are read from it)
    row_blocks: np.ndarray | None = None


@dataclass
class StepRequest:
    """One request of the step. Its tokens are rows [q_start, q_start + q_len) of the step's tensors."""

    index: int
    req_id: str
    q_start: int
    q_len: int
    seq_len: int  # computed + q_len
    prompt_len: int
    plan: RequestPlan | None = None  # compacts in this step
    policy: EvictionPolicy | None = None  # the request's policy when it compacts in this step
    decode: DecodeRecord | None = None  # its decode cap already applies in this step (a recomputed request)
    spare: int = 0  # spare blocks it compacts into (``layout/shared_prefix.py``; 0: in place)
