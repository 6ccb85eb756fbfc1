"""One generated prompt with its reference answers, and the JSON-lines file that carries samples between
the generator, the OpenAI runner and the kvpress script."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from vllm_kvevict.evaluation.tasks.base import Metric


@dataclass(frozen=True)
class Sample:
    """A prompt sized to ``target_tokens`` (``prompt_tokens`` is the exact count) and what it must answer."""

    id: str
    task: str
    target_tokens: int
    seed: int
    prompt: str
    prompt_tokens: int
    context_tokens: int
    """Leading tokens that form the compressible context; the question follows (question-agnostic runs), or,
    with the question first, is inside it (the whole user turn)."""
    answers: tuple[str, ...]
    metric: Metric
    max_new_tokens: int
    token_ids: tuple[int, ...] = ()

    def to_json(self) -> dict[str, object]:
        record = asdict(self)
        record["answers"] = list(self.answers)
        record["token_ids"] = list(self.token_ids)
        return record

    @classmethod
    def from_json(cls, record: dict[str, object]) -> Sample:
        fields = dict(record)
        fields["answers"] = tuple(fields["answers"])  # type: ignore[arg-type]
        fields["token_ids"] = tuple(fields.get("token_ids", ()))  # type: ignore[arg-type]
        return cls(**fields)  # type: ignore[arg-type]


def write_samples(path: str | Path, samples: list[Sample]) -> None:
    """Write ``samples`` as JSON lines (token ids included, for the kvpress side)."""
    with open(path, "w", encoding="utf-8") as out:
        for sample in samples:
            out.write(json.dumps(sample.to_json()) + "\n")


def read_samples(path: str | Path) -> list[Sample]:
    with open(path, encoding="utf-8") as src:
        return [Sample.from_json(json.loads(line)) for line in src if line.strip()]
