"""The benchmark workload: distinct long prompts of an exact token length, as token ids.

Prompts are prose-like text from a seeded word list, tokenized with the served model's tokenizer and cut to
exactly ``prompt_tokens`` ids, so every server sees the same tokens and no two prompts share a prefix block.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

WORDS = (
    "river market harbor lantern copper meadow signal winter orchard ledger bridge quarry canvas thunder "
    "garden pilot marble engine forest mirror saddle violet beacon timber falcon cinder crystal anchor "
    "compass velvet glacier summit hollow ember prairie cobalt willow granite tidal meteor basin lagoon "
    "archive cipher voyage mantle harvest kettle orbit plaza relic shelter spindle tundra vessel zephyr"
).split()
VERBS = "carried measured followed painted counted sheltered crossed repaired traded watched gathered".split()


@dataclass(frozen=True)
class Workload:
    """``num_prompts`` prompts of ``prompt_tokens`` token ids each, answered with ``output_tokens`` tokens."""

    prompts: list[list[int]]
    output_tokens: int

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompts[0])


def prose(rng: random.Random, num_sentences: int) -> str:
    sentences = []
    for index in range(num_sentences):
        subject, place, thing = rng.choice(WORDS), rng.choice(WORDS), rng.choice(WORDS)
        sentences.append(
            f"In the {place} {index}, the {subject} keeper {rng.choice(VERBS)} the {thing} "
            f"{rng.randint(2, 999)} times before the {rng.choice(WORDS)} {rng.choice(VERBS)} again."
        )
    return " ".join(sentences)


def build_workload(
    model_dir: Path, num_prompts: int, prompt_tokens: int, output_tokens: int, seed: int = 0
) -> Workload:
    """Deterministic for a seed: prompt i starts with its own number, so no KV block is shared."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = []
    for index in range(num_prompts):
        rng = random.Random(seed * 1_000_003 + index)
        head = f"Document {index}. Read it and then summarise it.\n"
        ids: list[int] = tokenizer.encode(head + prose(rng, 8), add_special_tokens=False)
        while len(ids) < prompt_tokens:
            ids += tokenizer.encode(" " + prose(rng, 64), add_special_tokens=False)
        prompts.append(ids[:prompt_tokens])
    return Workload(prompts=prompts, output_tokens=output_tokens)
