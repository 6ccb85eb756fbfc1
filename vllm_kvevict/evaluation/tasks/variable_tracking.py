"""Variable tracking (RULER vt): a chain of assignments hidden in noise; name each variable with a value."""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from vllm_kvevict.evaluation.haystacks import haystack_sentences, insert_at_depths
from vllm_kvevict.evaluation.tasks.base import Metric, TaskParts

HOPS = 4
EXAMPLE = (
    "For example, in the text 'VAR QWERT = 11111. The sky is blue. VAR ASDFG = VAR QWERT.' "
    "the variables assigned the value 11111 are QWERT and ASDFG."
)


def _variable_names(rng: random.Random, count: int) -> list[str]:
    names: list[str] = []
    while len(names) < count:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in names and name not in ("QWERT", "ASDFG"):
            names.append(name)
    return names


@dataclass(frozen=True)
class VariableTracking:
    """One chain ``X1 = v; X2 = X1; ...`` of ``HOPS`` hops in noise; answers: all ``HOPS + 1`` names."""

    name: str = "vt"
    description: str = f"a {HOPS}-hop chain of variable assignments in noise; list every variable = value"
    metric: Metric = "all"
    max_new_tokens: int = 40

    def build(self, seed: int, units: int, target_tokens: int) -> TaskParts:
        rng = random.Random(seed)
        names = _variable_names(rng, HOPS + 1)
        value = str(rng.randint(10_000, 99_999))
        statements = [f"VAR {names[0]} = {value}."]
        statements += [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, HOPS + 1)]
        depths = sorted(rng.random() for _ in statements)
        sentences = haystack_sentences("noise", rng.getrandbits(32), units)
        return TaskParts(
            instruction=f"Track the chain of variable assignments in the following text. {EXAMPLE}",
            context=insert_at_depths(sentences, statements, depths),
            question=f"Find all variables that are assigned the value {value} in the text above.",
            answer_prefix=(
                f"According to the chain of variable assignments in the text above, {HOPS + 1} variables "
                f"are assigned the value {value}, they are:"
            ),
            answers=tuple(names),
            unique_in_context=(value,),
        )
