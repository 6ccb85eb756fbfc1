"""The eviction datapath without vLLM or a backend: worker, step plan, step, and the one pipeline of the
three eviction modes (whole prompt, per chunk, decode-time cap)."""
