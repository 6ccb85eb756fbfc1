"""``vllm-kvevict soak``: bounded mixed traffic against a server with eviction, and what it left behind."""
