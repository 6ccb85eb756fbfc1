"""Turn a task into samples of an exact prompt length: search the number of units whose rendered prompt is
the longest not above the target.

Length tolerance: every prompt has ``target - LENGTH_TOLERANCE <= prompt_tokens <= target`` tokens. Units are
words or list entries (1-6 tokens), so the shortfall is at most one unit; prompts never exceed the target.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable

from vllm_kvevict.evaluation.prompt_format import PromptFormat
from vllm_kvevict.evaluation.sample import Sample
from vllm_kvevict.evaluation.tasks import Task, TaskParts, get_task

LENGTH_TOLERANCE = 8
MAX_ATTEMPTS = 20
_MIN_UNITS = 64
_POLISH_STEPS = 4


def derive_seed(*parts: object) -> int:
    """A stable 32-bit seed from any values (independent of Python's hash randomisation)."""
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def largest_fitting(length_of: Callable[[int], int], target: int, minimum: int) -> int:
    """The largest unit count ``n >= minimum`` with ``length_of(n) <= target``, for a length that grows with
    ``n`` (nearly monotonic lengths are handled by checking a few counts past the binary-search answer)."""
    if length_of(minimum) > target:
        raise ValueError(
            f"target of {target} tokens is below this task's shortest prompt "
            f"({length_of(minimum)} tokens at {minimum} units)"
        )
    low, high = minimum, minimum * 2
    while length_of(high) <= target:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if length_of(middle) <= target else (low, middle)
    best = low
    for n in range(low + 1, low + 1 + _POLISH_STEPS):
        if length_of(n) <= target:
            best = n
    return best


def _cached_length(task: Task, fmt: PromptFormat, seed: int, target_tokens: int) -> Callable[[int], int]:
    """Prompt tokens of ``task`` built with ``units``, memoised (the search asks some counts twice)."""
    lengths: dict[int, int] = {}

    def length_of(units: int) -> int:
        if units not in lengths:
            lengths[units] = fmt.count(task.build(seed, units, target_tokens))
        return lengths[units]

    return length_of


def _unique_ok(parts: TaskParts) -> bool:
    return all(parts.context.count(s) == 1 for s in parts.unique_in_context)


def generate_sample(task: Task, fmt: PromptFormat, target_tokens: int, seed: int, index: int) -> Sample:
    """The ``index``-th sample of ``task`` at ``target_tokens``, deterministic in (seed, task, length, index).

    A draw whose needle keys or values appear more than once (a haystack collision) is redrawn. A task
    with a ``seed_name`` (a variant of another task) draws that task's seeds."""
    seed_name = getattr(task, "seed_name", task.name)
    for attempt in range(MAX_ATTEMPTS):
        sample_seed = derive_seed(seed, seed_name, target_tokens, index, attempt)
        length_of = _cached_length(task, fmt, sample_seed, target_tokens)

        units = largest_fitting(length_of, target_tokens, _MIN_UNITS)
        parts = task.build(sample_seed, units, target_tokens)
        if not _unique_ok(parts):
            continue
        rendered = fmt.render(parts)
        return Sample(
            id=f"{task.name}-{target_tokens}-{index}",
            task=task.name,
            target_tokens=target_tokens,
            seed=sample_seed,
            prompt=rendered.text,
            prompt_tokens=len(rendered.token_ids),
            context_tokens=rendered.context_tokens,
            answers=parts.answers,
            metric=task.metric,
            max_new_tokens=task.max_new_tokens,
            token_ids=rendered.token_ids,
        )
    raise RuntimeError(
        f"{task.name}: no collision-free draw in {MAX_ATTEMPTS} attempts at {target_tokens} tokens"
    )


def generate_samples(
    task_names: Iterable[str], lengths: Iterable[int], samples_per_cell: int, seed: int, fmt: PromptFormat
) -> list[Sample]:
    """``samples_per_cell`` samples for every (task, length), tasks validated first."""
    tasks = [get_task(name) for name in task_names]
    lengths = list(lengths)
    if samples_per_cell < 1:
        raise ValueError(f"samples per (task, length) must be >= 1, got {samples_per_cell}")
    return [
        generate_sample(task, fmt, length, seed, index)
        for task in tasks
        for length in lengths
        for index in range(samples_per_cell)
    ]
