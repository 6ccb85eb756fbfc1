"""vLLM's CUDA platform on a CPU machine: NVML answers for one mocked H100 (tests and the job's dry run).

Call :func:`force_cuda_platform` before anything imports ``vllm.platforms``' current platform, in a process
whose ``sys.path`` starts with the bundle's vLLM tree (``vllm-0.32.0.dist-info`` beside it, so the version
has no ``cpu``) and with ``VLLM_TARGET_DEVICE`` unset. vLLM's own detection then runs unchanged:
``cuda_platform_plugin`` sees one device through NVML, the CPU plugin sees a non-CPU version, and
``vllm.platforms.cuda`` imports — with the bundle's ``_C_stable_libtorch`` stub — as ``NvmlCudaPlatform``.
Only NVML, Triton's NVIDIA driver check and the ``torch.cuda`` device queries vLLM's config code makes are
mocked; nothing runs on a device.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

DEVICE_NAME = "NVIDIA H100 80GB HBM3"
CAPABILITY = (9, 0)
TOTAL_MEMORY = 80 * 2**30


class _Handle:
    """What ``nvmlDeviceGetHandleByIndex(0)`` returns."""


def force_cuda_platform() -> None:
    """Mock NVML (one H100) and torch.cuda's capability/name/properties queries; see the module doc."""
    if os.environ.get("VLLM_TARGET_DEVICE"):
        raise RuntimeError("VLLM_TARGET_DEVICE is set: vLLM would skip CUDA detection; unset it")
    import torch
    from vllm.third_party import pynvml

    handle = _Handle()
    memory = SimpleNamespace(total=TOTAL_MEMORY, free=TOTAL_MEMORY, used=0)
    mocked = {
        "nvmlInit": lambda: None,
        "nvmlShutdown": lambda: None,
        "nvmlDeviceGetCount": lambda: 1,
        "nvmlDeviceGetHandleByIndex": lambda index: handle,
        "nvmlDeviceGetCudaComputeCapability": lambda h: CAPABILITY,
        "nvmlDeviceGetName": lambda h: DEVICE_NAME,
        "nvmlDeviceGetUUID": lambda h: "GPU-00000000-0000-0000-0000-000000000000",
        "nvmlDeviceGetMemoryInfo": lambda h: memory,
    }
    for name, value in mocked.items():
        setattr(pynvml, name, value)
    # vllm/triton_utils/importing.py keeps Triton only with exactly one active non-CPU driver
    from triton.backends import backends

    for name, backend in backends.items():
        if backend.driver is not None and name != "cpu":
            backend.driver.is_active = staticmethod(lambda active=(name == "nvidia"): active)
    torch.cuda.get_device_capability = lambda device=None: CAPABILITY
    torch.cuda.get_device_name = lambda device=None: DEVICE_NAME
    torch.cuda.get_device_properties = lambda device=None: SimpleNamespace(
        name=DEVICE_NAME, major=CAPABILITY[0], minor=CAPABILITY[1], total_memory=TOTAL_MEMORY,
        multi_processor_count=132, gcnArchName="",
    )
