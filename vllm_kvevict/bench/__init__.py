"""Capacity/throughput benchmark of vanilla vLLM vs vLLM with KV eviction (``vllm-kvevict bench``)."""
