"""Few-shot pattern induction: many ``word => code`` examples where every word of a kind shares one code;
the question asks the code of a word never shown, so only the pattern can answer it."""

from __future__ import annotations

import random
from dataclasses import dataclass

from vllm_kvevict.evaluation.tasks.base import Metric, TaskParts
from vllm_kvevict.evaluation.vocabulary import CATEGORIES, pseudo_words


@dataclass(frozen=True)
class FewShotPattern:
    """``units`` = example lines; the asked word is held out of every example."""

    name: str = "fewshot_pattern"
    description: str = "infer a word-kind => code mapping from in-context examples, for an unseen word"
    metric: Metric = "all"
    max_new_tokens: int = 12

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts:
        rng = random.Random(seed)
        kinds = sorted(CATEGORIES)
        codes = dict(zip(kinds, pseudo_words(rng, len(kinds)), strict=True))
        asked_kind = rng.choice(kinds)
        asked_word = rng.choice(CATEGORIES[asked_kind])
        pool = [(w, k) for k in kinds for w in CATEGORIES[k] if w != asked_word]
        lines = []
        for _ in range(units):
            word, kind = rng.choice(pool)
            lines.append(f"{word} => {codes[kind]}")
        return TaskParts(
            instruction="Each line below maps a word to a code. All words of the same kind share one code.",
            context="\n".join(lines),
            question=f"Following the same pattern, what is the code of the word '{asked_word}'?",
            answer_prefix=f"{asked_word} =>",
            answers=(codes[asked_kind],),
        )
