"""Each request's eviction plan and per-request setting on the worker, resolved exactly like the scheduler's
manager does: the plan of the prompt after the tokens it found in the prefix cache
(``layout/shared_prefix.py``), or of its kept context (``layout/context_reuse.py``)."""

from __future__ import annotations

from vllm_kvevict.datapath.step_inputs import StepInputs
from vllm_kvevict.layout.accounting import RequestPlan
from vllm_kvevict.layout.context_reuse import context_plan
from vllm_kvevict.layout.shared_prefix import private_plan
from vllm_kvevict.settings.request_settings import RequestSettings, ResolvedSetting


class RequestPlans:
    """Plans of the requests of a worker, from the server's settings and what each request shares."""

    def __init__(self, settings: RequestSettings, block_size: int, num_layers: int) -> None:
        self.settings = settings
        self.block_size = block_size
        self.num_layers = num_layers
        #: request -> prompt tokens it found in vLLM's prefix cache (its computed tokens when first seen)
        self.shared_tokens: dict[str, int] = {}

    def plan_of(
        self, inputs: StepInputs, slot: int, prompt_len: int
    ) -> tuple[RequestPlan, ResolvedSetting | None]:
        """(plan, per-request setting or None) of the request in ``slot``, whose prompt (a creator's context
        already) has ``prompt_len`` tokens."""
        setting = self.settings.resolve(inputs.extra_args[slot] if inputs.extra_args else None)
        shared = self.shared_tokens.get(inputs.req_ids[slot], 0)
        if setting is not None and setting.keeps_context:  # prompt_len: a creator's context already
            plan = context_plan(setting.plan_for, prompt_len, shared, self.block_size, self.num_layers)
            return plan, setting
        plan_for = setting.plan_for if setting else self.settings.plan_for
        return private_plan(plan_for, prompt_len, shared, self.settings.server.min_freed_share), setting
