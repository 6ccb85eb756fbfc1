"""Long-context answer quality of a served model: RULER-style task generators sized to exact token counts,
RULER's scorers, an OpenAI-compatible client runner, and the vLLM-vs-kvpress comparison with its report."""
