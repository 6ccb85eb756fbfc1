"""Kernel tests import their sibling helpers (kernel_cases, triton_aot) by name in any pytest import mode."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)
