"""Triton kernels: observation-window scoring, compaction, ragged per-head paged attention."""
