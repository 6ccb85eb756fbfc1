"""Summary recall: a few journeys told inside essay prose; a summary must name every destination."""

from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_kvevict.evaluation.haystacks import haystack_sentences, insert_at_depths
from vllm_kvevict.evaluation.tasks.base import Metric, TaskParts
from vllm_kvevict.evaluation.vocabulary import ADJECTIVES, CITIES, FIRST_NAMES, NOUNS

JOURNEYS = 5


@dataclass(frozen=True)
class SummaryRecall:
    """``JOURNEYS`` sentences "Name travelled to City ..." at random depths (``units`` = haystack words);
    scored by the fraction of cities the summary names."""

    name: str = "summary_recall"
    description: str = f"summarise {JOURNEYS} journeys scattered in prose; recall of the destinations"
    metric: Metric = "all"
    max_new_tokens: int = 128

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts:
        rng = random.Random(seed)
        people = rng.sample(FIRST_NAMES, JOURNEYS)
        cities = rng.sample(CITIES, JOURNEYS)
        events = [
            f"{person} travelled to {city} to see the {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)}."
            for person, city in zip(people, cities, strict=True)
        ]
        depths = sorted(rng.random() for _ in events)
        sentences = haystack_sentences("essay", rng.getrandbits(32), units)
        return TaskParts(
            instruction="Read the following text. Some people in it travel to other cities.",
            context=insert_at_depths(sentences, events, depths),
            question="Summarize the journeys in the text above: name the city each traveller went to.",
            answer_prefix="Summary of the journeys:",
            answers=tuple(cities),
            unique_in_context=(*people, *cities),
        )
