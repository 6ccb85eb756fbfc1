"""Eviction settings without vLLM: the server's configuration, per-request overrides, and their parsing."""
