"""Everything that touches vLLM: plugin, CLI flags, attention backends, KV-cache spec and manager, patches."""
