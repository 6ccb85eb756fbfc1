from vllm_kvevict.vllm_adapter.config import *  # noqa: F401,F403  TEMP
from vllm_kvevict.vllm_adapter.config import EvictionConfig  # noqa: F401 TEMP
