"""The dotted paths of the vLLM classes and modules that several entries of the listing name."""

RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
SCHEDULER = "vllm.v1.core.sched.scheduler.Scheduler"
KV_MANAGER = "vllm.v1.core.kv_cache_manager.KVCacheManager"
ENGINE_ARGS = "vllm.engine.arg_utils.EngineArgs"
CPU = "vllm.v1.attention.backends.cpu_attn"
TRITON = "vllm.v1.attention.backends.triton_attn"
