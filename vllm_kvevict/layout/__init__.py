"""Paged memory layout of evicted caches: sub-block tables, block accounting, compaction. No vLLM import."""
