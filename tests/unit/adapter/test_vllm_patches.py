"""The fixes of vLLM itself (``vllm_adapter/vllm_patches.py``), on real torch generators and vLLM's classes.

The server-level proof (a seeded request on a chunked prompt is answered, the same every time and at any
chunk size) is ``tests/reliability/test_chunked_sampling.py``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_kvevict.vllm_adapter import vllm_patches


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def draw(generator: torch.Generator) -> int:
    """What vLLM 0.32.0's CPU sampler takes from a request's generator (TopKTopPSampler.forward_cpu)."""
    return int(torch.randint(0, 2**31, (1,), generator=generator, dtype=torch.long).item())


def runner_with(generators: dict[int, torch.Generator], discarded: list[bool]) -> SimpleNamespace:
    """The attributes of GPUModelRunner the wrappers read: the batch's generators and the discard mask."""
    batch = SimpleNamespace(generators=generators, num_reqs=len(discarded))
    return SimpleNamespace(input_batch=batch, discard_request_mask=SimpleNamespace(np=np.array(discarded)))


def test_cpu_generators_have_no_offset_which_vllm_rewinds():
    """The premise of the fix: vLLM's rewind (``gen.set_offset(gen.get_offset() - 4)``) raises on CPU."""
    with pytest.raises(RuntimeError, match="does not use offset"):
        seeded(1).get_offset()


def sample_every_request(runner) -> list[int]:
    return [draw(generator) for _, generator in sorted(runner.input_batch.generators.items())]


def test_a_partial_prefill_sample_leaves_its_generator_where_it_was():
    partial, full = seeded(1), seeded(2)
    runner = runner_with({0: partial, 1: full}, discarded=[True, False])
    for _ in range(3):  # three partial-prefill steps
        vllm_patches._sample_keeping_discarded_cpu_generators(sample_every_request, runner)
    # The first token after the prompt is drawn as if the prompt had come in one step ...
    assert draw(partial) == draw(seeded(1))
    # ... while a request that really sampled advanced its stream once per step.
    reference = seeded(2)
    for _ in range(3):
        draw(reference)
    assert draw(full) == draw(reference)


def test_bookkeeping_does_not_rewind_cpu_generators_and_keeps_the_batch_generators():
    partial, full = seeded(1), seeded(2)
    generators = {0: partial, 1: full}
    runner = runner_with(generators, discarded=[True, False])

    def vllm_rewind_loop(runner_):
        # vLLM 0.32.0 GPUModelRunner._bookkeeping_sync, its first lines.
        for index in np.nonzero(runner_.discard_request_mask.np[: runner_.input_batch.num_reqs])[0]:
            generator = runner_.input_batch.generators.get(int(index))
            if generator is not None:
                generator.set_offset(generator.get_offset() - 4)
        return "done"

    with pytest.raises(RuntimeError, match="does not use offset"):
        vllm_rewind_loop(runner)
    assert vllm_patches._bookkeeping_without_cpu_rewind(vllm_rewind_loop, runner) == "done"
    assert runner.input_batch.generators == {0: partial, 1: full}


def test_install_wraps_the_runner_methods_once():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    vllm_patches.install_vllm_fixes()
    wrapped = GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync
    vllm_patches.install_vllm_fixes()
    assert (GPUModelRunner._sample, GPUModelRunner._bookkeeping_sync) == wrapped
    assert all(getattr(method, vllm_patches._WRAPPED_MARK) for method in wrapped)


