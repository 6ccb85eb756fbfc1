"""Aggregation families of RULER: common-words extraction (cwe) and frequent-words extraction (fwe).

Both use made-up words so that no word is common in the model's training data by accident."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from vllm_kvevict.evaluation.tasks.base import Metric, TaskParts
from vllm_kvevict.evaluation.vocabulary import pseudo_words

COMMON_WORDS = 10
UNCOMMON_REPEATS = 3
FREQUENT_WORDS = 3
ZIPF_ALPHA = 2.0


def common_word_repeats(target_tokens: int) -> int:
    """How often each common word appears: more in longer prompts (6 at 1k .. 30 at 7.5k), always > 3."""
    return max(6, min(30, target_tokens // 250))


@dataclass(frozen=True)
class CommonWords:
    """A shuffled list where ``COMMON_WORDS`` words repeat often and the rest 3 times (``units`` = entries of
    uncommon words); answers: the common words."""

    name: str = "cwe"
    description: str = f"list the {COMMON_WORDS} most common words of a long word list"
    metric: Metric = "all"
    max_new_tokens: int = 96

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts:
        rng = random.Random(seed)
        distinct_uncommon = math.ceil(units / UNCOMMON_REPEATS)
        vocabulary = pseudo_words(rng, COMMON_WORDS + distinct_uncommon)
        common, uncommon = vocabulary[:COMMON_WORDS], vocabulary[COMMON_WORDS:]
        entries = [w for w in common for _ in range(common_word_repeats(target_tokens))]
        entries += [w for w in uncommon for _ in range(UNCOMMON_REPEATS)][:units]
        random.Random(seed + 1).shuffle(entries)
        return TaskParts(
            instruction=(
                "Below is a list of words. Some words appear more often than others. "
                "Memorize the ones that appear most often."
            ),
            context=" ".join(entries),
            question=f"What are the {COMMON_WORDS} most common words in the above list?",
            answer_prefix=f"The top {COMMON_WORDS} words that appear most often in the list are:",
            answers=tuple(common),
        )


def zipf_counts(total: int) -> list[int]:
    """Occurrences per rank (rank 1 first) of ``total`` words following Zipf's law with ``ZIPF_ALPHA``;
    the tail words appear once, and the counts add up to ``total``."""
    zeta = sum(1.0 / r**ZIPF_ALPHA for r in range(1, 10_000))
    counts: list[int] = []
    while sum(counts) < total:
        rank = len(counts) + 1
        counts.append(max(1, int(total / (rank**ZIPF_ALPHA * zeta))))
    counts[-1] -= sum(counts) - total
    return counts


@dataclass(frozen=True)
class FrequentWords:
    """Coded text whose word frequencies follow Zipf's law (``units`` = words); answers: the top 3 words."""

    name: str = "fwe"
    description: str = f"name the {FREQUENT_WORDS} most frequent words of a Zipf-distributed coded text"
    metric: Metric = "all"
    max_new_tokens: int = 40

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts:
        counts = zipf_counts(units)
        if len(counts) <= FREQUENT_WORDS or counts[FREQUENT_WORDS - 1] <= counts[FREQUENT_WORDS]:
            raise ValueError(f"{units} words are too few for a strict top {FREQUENT_WORDS}")
        rng = random.Random(seed)
        vocabulary = pseudo_words(rng, len(counts))
        words = [w for w, c in zip(vocabulary, counts, strict=True) for _ in range(c)]
        random.Random(seed + 1).shuffle(words)
        return TaskParts(
            instruction=(
                "Read the following coded text and track the frequency of each coded word. "
                f"Find the {FREQUENT_WORDS} most frequently appearing coded words."
            ),
            context=" ".join(words),
            question=f"What are the {FREQUENT_WORDS} most frequent words in the above coded text?",
            answer_prefix=(
                f"According to the coded text above, the {FREQUENT_WORDS} most frequent words are:"
            ),
            answers=tuple(vocabulary[:FREQUENT_WORDS]),
        )
