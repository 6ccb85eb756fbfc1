"""Every part of vLLM the plugin relies on, in one listing: what it imports (``imports.py``), the methods it
wraps, overrides or calls with their parameters as vLLM ``CHECKED_VLLM_VERSION`` defines them
(``methods.py``) and the attributes of vLLM's objects it reads (``attributes.py``), each a ``VllmPart`` with
why. vLLM has no stable API below ``LLM`` and ``SamplingParams``, so every import is listed, public or not.

``tests/unit/adapter/test_vllm_boundary.py`` checks each entry against the installed vLLM (importable, the
parameters unchanged, the attributes still defined) and that no module of ``vllm_kvevict`` imports, wraps or
overrides a part of vLLM missing here: a vLLM upgrade starts with that test. The code that reaches in stays
where it works: reads and calls of private parts in ``vllm_private.py``, wrappers in ``vllm_patches.py``.
"""

from __future__ import annotations

from vllm_kvevict.vllm_adapter.vllm_boundary.attributes import READ
from vllm_kvevict.vllm_adapter.vllm_boundary.imports import IMPORTS
from vllm_kvevict.vllm_adapter.vllm_boundary.methods import CALLED, OVERRIDDEN, WRAPPED
from vllm_kvevict.vllm_adapter.vllm_boundary.part import VllmPart, imported
from vllm_kvevict.vllm_adapter.vllm_patches import TESTED_VLLM_VERSION

#: the vLLM release every entry was checked on
CHECKED_VLLM_VERSION = TESTED_VLLM_VERSION

__all__ = [
    "CALLED",
    "CHECKED_VLLM_VERSION",
    "IMPORTS",
    "OVERRIDDEN",
    "READ",
    "WRAPPED",
    "VllmPart",
    "imported",
]
