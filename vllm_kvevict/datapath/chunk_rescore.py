"""A request whose prompt is evicted while it arrives, as one step's per-chunk re-score sees it
(``chunk_eviction.py`` describes its layers; ``executor.py`` runs them)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict.datapath.step_inputs import StepRequest
from vllm_kvevict.layout.accounting import RequestPlan
from vllm_kvevict.policies.base import EvictionPolicy


@dataclass
class ChunkRescore:
    """A request prefilling a chunk of a prompt that compacts. Its tokens are rows [q_start, q_start + q_len)
    of the step's tensors; ``computed`` -> ``seq_len`` tokens are in the cache before -> after the step;
    ``evicts``: the rule evicts after this chunk (else only its queries are kept for a later window).
    ``shared``: prompt tokens it started with from vLLM's prefix cache (blocks other requests share, kept
    whole); ``plan`` is then the plan of the rest of its prompt (``layout/shared_prefix.py``)."""

    slot: int
    req_id: str
    q_start: int
    q_len: int
    computed: int
    seq_len: int
    plan: RequestPlan
    policy: EvictionPolicy
    compacted: bool  # reads sub-block tables already (an earlier chunk was evicted)
    evicts: bool = True
    reads_statistics: bool = False  # judged by Expected Attention: every prompt query is folded in
    shared: int = 0
    deferred: bool = False  # the last chunk, compacted after the step's forward by the question echo
    spare: int = 0  # spare blocks the final chunk compacts into (``layout/shared_prefix.py``; 0: in place)

    @property
    def rescores_now(self) -> bool:
        """True when this step's forward re-scores it (not deferred to the echo pass)."""
        return self.evicts and not self.deferred

    @property
    def prompt_len(self) -> int:
        return self.shared + self.plan.prompt_len

    @property
    def final(self) -> bool:
        """The prompt completes in this step: the method's own selection, down to the layer budgets."""
        return self.seq_len >= self.prompt_len

    def budget(self, layer_idx: int) -> int:
        """Entries per head ``layer_idx`` keeps: its layer budget after the last chunk, ``a(n1)`` before."""
        if self.final:
            return self.plan.layer_budgets[layer_idx]
        return self.plan.kept_length_at(self.seq_len - self.shared)

    @property
    def trailing(self) -> int:
        """Tokens after the prompt computed in this step (a request recomputed after preemption)."""
        return max(0, self.seq_len - self.prompt_len)

    def as_request(self) -> StepRequest:
        return StepRequest(self.slot, self.req_id, self.q_start, self.q_len, self.seq_len, self.prompt_len)
