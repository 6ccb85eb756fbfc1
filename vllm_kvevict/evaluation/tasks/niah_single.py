"""Single needle in a haystack (RULER niah_single): one key, one 7-digit value, three haystack kinds."""

from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_kvevict.evaluation.haystacks import haystack_sentences, insert_at_depths
from vllm_kvevict.evaluation.tasks.base import Metric, TaskParts
from vllm_kvevict.evaluation.tasks.needles import INSTRUCTION, needle
from vllm_kvevict.evaluation.vocabulary import magic_key, magic_number


@dataclass(frozen=True)
class SingleNeedle:
    """One needle at a random depth of a noise, essay or digits haystack; ``units`` = haystack words."""

    haystack: str
    metric: Metric = "all"
    max_new_tokens: int = 24

    @property
    def name(self) -> str:
        return f"niah_single_{self.haystack}"

    @property
    def description(self) -> str:
        return f"one needle (7-digit value under a key) in a {self.haystack} haystack"

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts:
        rng = random.Random(seed)
        key, value, depth = magic_key(rng), magic_number(rng), rng.random()
        sentences = haystack_sentences(self.haystack, rng.getrandbits(32), units)
        return TaskParts(
            instruction=INSTRUCTION,
            context=insert_at_depths(sentences, [needle(key, value)], [depth]),
            question=f"What is the special magic number for {key} mentioned in the provided text?",
            answer_prefix=f"The special magic number for {key} mentioned in the provided text is",
            answers=(value,),
            unique_in_context=(key, value),
        )
