"""API-server validation of the per-request ``vllm_xargs`` keys, through vLLM's own extension point.

vLLM 0.32.0 validates custom per-request arguments with ``LogitsProcessor.validate_params``: the API server's
``InputProcessor._validate_params`` calls it for every request of every processor in
``ModelConfig.logits_processors``, before the request reaches the engine; a ``VLLMValidationError`` becomes
HTTP 400. So no vLLM function is wrapped here: ``cli_args`` adds this class to
``--logits-processors`` when eviction is on. On the worker it is a no-op processor (argmax invariant, logits
returned unchanged).

The server's setting reaches ``validate_params`` (a classmethod with no config) through an environment
variable set by the ``vllm serve`` flag handling before any API server process starts.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache

import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

from vllm_kvevict.vllm_adapter.config import EvictionConfig, EvictionConfigError, eviction_config_from_json
from vllm_kvevict.vllm_adapter.request_settings import parse_override

#: JSON of the server's EvictionConfig, read by the API server processes.
SERVER_CONFIG_ENV = "KVEVICT_SERVER_EVICTION"
#: what ``--logits-processors`` gets (vLLM's "<module>:<class>" form).
VALIDATOR_FQCN = f"{__name__}:EvictionArgsValidator"


def publish_server_config(config: EvictionConfig) -> None:
    """Make the server's setting visible to this process and the API server processes it spawns."""
    os.environ[SERVER_CONFIG_ENV] = json.dumps(config.to_dict(), sort_keys=True)


@lru_cache(maxsize=4)
def _server_config(text: str) -> EvictionConfig:
    return eviction_config_from_json(text)


def validate_request_args(sampling_params: SamplingParams) -> None:
    """Raise VLLMValidationError (HTTP 400) naming the bad ``vllm_xargs`` value and the valid ones."""
    text = os.environ.get(SERVER_CONFIG_ENV)
    if not text:
        return  # no eviction on this server: the keys are not read anywhere
    try:
        parse_override(sampling_params.extra_args, _server_config(text))
    except EvictionConfigError as exc:
        raise VLLMValidationError(str(exc), parameter="vllm_xargs") from None


class EvictionArgsValidator(LogitsProcessor):
    """Validates ``kv_eviction``/``kv_budget`` per request; changes no logits."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        validate_request_args(sampling_params)

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        pass

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        pass
