"""vllm-kvevict: per-head KV-cache eviction for vLLM that frees paged blocks.

Layers (arrows point down only): ``vllm_adapter`` -> ``layout`` -> ``policies``.
"""

__version__ = "0.1.0"
