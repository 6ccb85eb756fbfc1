"""What ``vllm-kvevict calibrate`` fits on and how (no torch import: the CLI reads the defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FitConfig:
    """ridge: the L2 penalty per sample (on standardised features); hidden_dim, epochs, batch_size, lr: the
    MLP's width and training; seed: the MLP's initialisation and batch order; heads: "separate" (each KV
    head's output reads only its own head's features: block-diagonal weights, what per-chunk eviction
    needs) or "joint" (every output reads every head's features; ``calibration/fit.py``)."""

    ridge: float = 1e-3
    hidden_dim: int = 32
    epochs: int = 10
    batch_size: int = 512
    lr: float = 3e-3
    seed: int = 0
    heads: str = "separate"


@dataclass(frozen=True)
class CalibrationConfig:
    """What to calibrate on and how to fit (see ``vllm-kvevict calibrate --help``)."""

    num_contexts: int = 32
    held_out: int = 6
    min_tokens: int = 512
    max_tokens: int = 1536
    chunk_size: int = 2048
    seed: int = 0
    features: str = "kv-pair-norms"
    compare: bool = True
    dtype: str = "float16"
    fit: FitConfig = field(default_factory=FitConfig)
