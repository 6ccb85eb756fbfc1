"""Haystacks: the filler text that hides needles, cut to an exact number of words.

Three kinds, as RULER's single-needle family: ``noise`` (one short passage repeated, the passkey-retrieval
filler), ``essay`` (prose from a seeded grammar, so each prompt reads differently) and ``digits`` (groups of
random digits, where a 7-digit needle value looks like its surroundings).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from vllm_kvevict.evaluation import vocabulary as V

NOISE_PASSAGE: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

_ESSAY_TEMPLATES: tuple[str, ...] = (
    "The {adj} {noun} {verb} the {noun2} {prep} the {adj2} {noun3}.",
    "Every {noun} in the {noun2} {adv} {verb} a {adj} {noun3}.",
    "Nobody {verb} the {noun} until the {adj} {noun2} arrived.",
    "It is often said that a {adj} {noun} is worth more than a {adj2} {noun2}.",
    "Long ago, a {noun} {verb} the {adj} {noun2} and never looked back.",
    "Some people believe the {noun} {adv} {verb} the {noun2}, but the evidence is {adj}.",
    "When the {noun} {verb} the {noun2}, the whole {noun3} grew {adj}.",
    "A {adj} {noun} {prep} the {noun2} {verb} what the {noun3} had left behind.",
    "In the end, the {noun} was {adj}, and the {noun2} {adv} {verb} it.",
    "Most {noun}s that {verb} a {noun2} later become {adj}.",
    "The story of the {adj} {noun} and the {noun2} is told in every {noun3}.",
    "Why the {noun} {verb} the {adj} {noun2} remains a question for the {noun3}.",
)


def noise_sentence(rng: random.Random, index: int) -> str:
    """The ``index``-th sentence of the repeated noise passage (``rng`` unused: noise is fixed)."""
    return NOISE_PASSAGE[index % len(NOISE_PASSAGE)]


def essay_sentence(rng: random.Random, index: int) -> str:
    """One sentence of essay-like prose from the seeded grammar."""
    template = rng.choice(_ESSAY_TEMPLATES)
    return template.format(
        adj=rng.choice(V.ADJECTIVES),
        adj2=rng.choice(V.ADJECTIVES),
        noun=rng.choice(V.NOUNS),
        noun2=rng.choice(V.NOUNS),
        noun3=rng.choice(V.NOUNS),
        verb=rng.choice(V.VERBS_PAST),
        adv=rng.choice(V.ADVERBS),
        prep=rng.choice(V.PREPOSITIONS),
    )


def digits_sentence(rng: random.Random, index: int) -> str:
    """Eight groups of five random digits; a group never holds a 7-digit run, so needle values stay unique."""
    return " ".join("".join(rng.choice("0123456789") for _ in range(5)) for _ in range(8))


HAYSTACK_KINDS: dict[str, Callable[[random.Random, int], str]] = {
    "noise": noise_sentence,
    "essay": essay_sentence,
    "digits": digits_sentence,
}


def haystack_sentences(kind: str, seed: int, num_words: int) -> list[str]:
    """Sentences of haystack ``kind`` holding exactly ``num_words`` words (the last one may be cut short).

    The same ``(kind, seed)`` always yields the same stream, so a longer haystack extends a shorter one.
    """
    if kind not in HAYSTACK_KINDS:
        raise ValueError(f"unknown haystack kind {kind!r}; valid kinds: {', '.join(HAYSTACK_KINDS)}")
    return sentences_from(HAYSTACK_KINDS[kind], seed, num_words)


def sentences_from(make: Callable[[random.Random, int], str], seed: int, num_words: int) -> list[str]:
    """Sentences ``make(rng, index)`` for index 0, 1, ... until they hold exactly ``num_words`` words."""
    rng = random.Random(seed)
    sentences: list[str] = []
    remaining = num_words
    index = 0
    while remaining > 0:
        words = make(rng, index).split()
        sentences.append(" ".join(words[:remaining]))
        remaining -= min(remaining, len(words))
        index += 1
    return sentences


def insert_at_depths(sentences: Sequence[str], inserts: Sequence[str], depths: Sequence[float]) -> str:
    """Join ``sentences``, each of ``inserts`` placed between sentences at its fractional depth in [0, 1]."""
    if len(inserts) != len(depths):
        raise ValueError(f"{len(inserts)} inserts but {len(depths)} depths")
    slots: dict[int, list[str]] = {}
    for text, depth in zip(inserts, depths, strict=True):
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth {depth} is outside [0, 1]")
        slots.setdefault(round(depth * len(sentences)), []).append(text)
    parts: list[str] = []
    for i in range(len(sentences) + 1):
        parts.extend(slots.get(i, ()))
        if i < len(sentences):
            parts.append(sentences[i])
    return " ".join(parts)
