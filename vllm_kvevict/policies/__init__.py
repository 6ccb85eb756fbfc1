"""Eviction policies: pure torch, device-agnostic, no vLLM import."""
