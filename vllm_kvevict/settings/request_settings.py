from vllm_kvevict.vllm_adapter.request_settings import *  # noqa: F401,F403  TEMP
from vllm_kvevict.vllm_adapter.request_settings import ResolvedSetting, decode_policy  # noqa: F401 TEMP
