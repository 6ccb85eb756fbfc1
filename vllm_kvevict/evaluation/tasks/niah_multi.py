"""Multi-needle families of RULER: multi-key (with distractors, or a haystack made only of distractor
needles), multi-value (one key, several values) and multi-query (several keys asked at once)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_kvevict.evaluation.haystacks import haystack_sentences, insert_at_depths, sentences_from
from vllm_kvevict.evaluation.tasks.base import Metric, TaskParts
from vllm_kvevict.evaluation.tasks.needles import (
    INSTRUCTION,
    distinct_keys,
    distinct_values,
    needle,
    sorted_depths,
)
from vllm_kvevict.evaluation.vocabulary import magic_key, magic_number

NEEDLES = 4


def _distractor_needle(rng: random.Random, index: int) -> str:
    return needle(magic_key(rng), magic_number(rng))


@dataclass(frozen=True)
class MultiKey:
    """Four needles with different keys, one asked. ``hard``: the haystack itself is distractor needles
    (RULER niah_multikey_2), otherwise essay prose (niah_multikey_1). ``units`` = haystack words."""

    hard: bool = False
    metric: Metric = "all"
    max_new_tokens: int = 24

    @property
    def name(self) -> str:
        return "niah_multikey_hard" if self.hard else "niah_multikey"

    @property
    def description(self) -> str:
        where = (
            "a haystack made of distractor needles" if self.hard else "essay prose with 3 distractor needles"
        )
        return f"one of four keyed needles asked, in {where}"

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts:
        rng = random.Random(seed)
        keys, values = distinct_keys(rng, NEEDLES), distinct_values(rng, NEEDLES)
        depths = sorted_depths(rng, NEEDLES)
        order = list(range(NEEDLES))
        rng.shuffle(order)
        haystack_seed = rng.getrandbits(32)
        if self.hard:
            sentences = sentences_from(_distractor_needle, haystack_seed, units)
        else:
            sentences = haystack_sentences("essay", haystack_seed, units)
        inserts = [needle(keys[i], values[i]) for i in order]
        return TaskParts(
            instruction=INSTRUCTION,
            context=insert_at_depths(sentences, inserts, depths),
            question=f"What is the special magic number for {keys[0]} mentioned in the provided text?",
            answer_prefix=f"The special magic number for {keys[0]} mentioned in the provided text is",
            answers=(values[0],),
            unique_in_context=(*keys, *values),
        )


@dataclass(frozen=True)
class MultiValue:
    """Four values hidden under the same key in essay prose; all four must be returned. ``units`` = words."""

    name: str = "niah_multivalue"
    description: str = "four values under one key in essay prose, all asked"
    metric: Metric = "all"
    max_new_tokens: int = 64

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts:
        rng = random.Random(seed)
        key, values = magic_key(rng), distinct_values(rng, NEEDLES)
        depths = sorted_depths(rng, NEEDLES)
        sentences = haystack_sentences("essay", rng.getrandbits(32), units)
        return TaskParts(
            instruction=INSTRUCTION,
            context=insert_at_depths(sentences, [needle(key, v) for v in values], depths),
            question=f"What are all the special magic numbers for {key} mentioned in the provided text?",
            answer_prefix=f"The special magic numbers for {key} mentioned in the provided text are",
            answers=tuple(values),
            unique_in_context=tuple(values),
        )


@dataclass(frozen=True)
class MultiQuery:
    """Four keyed needles in essay prose, all four keys asked at once. ``units`` = haystack words."""

    name: str = "niah_multiquery"
    description: str = "four keyed needles in essay prose, all four keys asked in one question"
    metric: Metric = "all"
    max_new_tokens: int = 64

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts:
        rng = random.Random(seed)
        keys, values = distinct_keys(rng, NEEDLES), distinct_values(rng, NEEDLES)
        depths = sorted_depths(rng, NEEDLES)
        order = list(range(NEEDLES))
        rng.shuffle(order)
        sentences = haystack_sentences("essay", rng.getrandbits(32), units)
        asked = ", ".join(keys[:-1]) + f", and {keys[-1]}"
        return TaskParts(
            instruction=INSTRUCTION,
            context=insert_at_depths(sentences, [needle(keys[i], values[i]) for i in order], depths),
            question=f"What are all the special magic numbers for {asked} mentioned in the provided text?",
            answer_prefix=f"The special magic numbers for {asked} mentioned in the provided text are",
            answers=tuple(values),
            unique_in_context=(*keys, *values),
        )
