"""Seeded needle-in-a-haystack prompts (RULER's single-needle task), sized in tokens of the served model.

The haystack is generated prose (templated sentences over small word lists); one sentence, the needle,
states a 7-digit number for a key, and the question asks for it. The prompt is the chat template around
``context + question``; its token ids are built from two separately tokenised parts (context, then question
with the assistant header and an answer prefix), so the context boundary is an exact token index, the same
for our policies and for kvpress.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

_SUBJECTS = (
    "The old miller",
    "A quiet student",
    "The harbour master",
    "Every traveller",
    "The gardener",
    "A young painter",
    "The village council",
    "The night watchman",
    "An elderly baker",
    "The ferryman",
)
_VERBS = (
    "remembered",
    "described",
    "repaired",
    "carried",
    "admired",
    "questioned",
    "painted",
    "counted",
    "forgot",
    "discovered",
)
_OBJECTS = (
    "the stone bridge",
    "a basket of apples",
    "the northern road",
    "an unfinished letter",
    "the copper kettle",
    "a map of the valley",
    "the winter market",
    "a broken lantern",
    "the long table",
    "a field of barley",
)
_ENDINGS = (
    "before the rain began.",
    "while the bells were ringing.",
    "after a long day of work.",
    "without saying a word.",
    "as the sun went down.",
    "on the first morning of spring.",
    "in the middle of the square.",
    "with great patience.",
    "for the third time that week.",
    "near the edge of the forest.",
)
_KEY_WORDS = (
    "amber",
    "cobalt",
    "falcon",
    "harbor",
    "lantern",
    "meadow",
    "orchid",
    "quartz",
    "saffron",
    "thistle",
    "velvet",
    "willow",
)


@dataclass(frozen=True)
class NeedlePrompt:
    """One sample. input_ids: the whole prompt; context_len: tokens before the question starts."""

    length: int
    sample: int
    input_ids: list[int]
    context_len: int
    answer: str
    needle_depth: float


def _sentence(rng: random.Random) -> str:
    return f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}"


def needle_prompt(tokenizer, length: int, sample: int, seed: int = 0) -> NeedlePrompt:
    """A prompt of about ``length`` tokens (within one sentence) for sample number ``sample``."""
    rng = random.Random(f"{seed}-{length}-{sample}")
    key = f"{rng.choice(_KEY_WORDS)}-{rng.choice(_KEY_WORDS)}"
    answer = str(rng.randrange(1_000_000, 10_000_000))
    needle = f"The special magic number for {key} is: {answer}."
    question = f"\n\nWhat is the special magic number for {key} mentioned in the provided text?"
    answer_prefix = f"The special magic number for {key} is:"

    separator = "\x00QUESTION\x00"
    templated = tokenizer.apply_chat_template(
        [{"role": "user", "content": f"HAYSTACK{separator}"}], add_generation_prompt=True, tokenize=False
    )
    head, tail = templated.split(separator)
    head = head.replace("HAYSTACK", "")

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    question_ids = encode(question + tail + answer_prefix)
    head_ids = encode(head)
    budget = length - len(head_ids) - len(question_ids)
    sentences = []
    used = 0
    while used < budget:
        sentence = _sentence(rng)
        used += len(encode(" " + sentence))
        sentences.append(sentence)
    depth = rng.uniform(0.1, 0.9)
    sentences.insert(int(depth * len(sentences)), needle)
    context_ids = head_ids + encode(" ".join(sentences))
    return NeedlePrompt(
        length=length,
        sample=sample,
        input_ids=context_ids + question_ids,
        context_len=len(context_ids),
        answer=answer,
        needle_depth=depth,
    )


def is_correct(answer_text: str, expected: str) -> bool:
    """RULER's string match: the expected number appears in the generated answer."""
    return expected in answer_text
