"""Everything that touches vLLM: plugin, CLI flags, attention backend, KV-cache spec and manager, metrics."""
