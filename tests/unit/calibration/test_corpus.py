"""The calibration corpus: deterministic, of the asked lengths, and free of evaluation-task text."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_kvevict.calibration.corpus import (
    calibration_contexts,
    corpus_documents,
    default_documents,
    evaluation_literals,
    is_evaluation_text,
)
from vllm_kvevict.evaluation.haystacks import haystack_sentences
from vllm_kvevict.evaluation.tasks.needles import INSTRUCTION, needle

PROSE = "This module formats dates. " * 20


def test_evaluation_literals_hold_the_needle_wording_and_the_haystack_sentences() -> None:
    literals = evaluation_literals()
    assert INSTRUCTION in literals
    assert any("special magic numbers for" in literal for literal in literals)
    assert is_evaluation_text("Some text. " + needle("alpha-bravo", "1234567") + " More text.", literals)
    assert not is_evaluation_text(PROSE, literals)


def test_a_docstring_with_evaluation_text_is_dropped(tmp_path: Path) -> None:
    sentence = next(s for s in haystack_sentences("noise", 0, 200) if len(s) >= 20)
    (tmp_path / "plain.py").write_text(f'"""{PROSE}"""\n')
    (tmp_path / "haystack.py").write_text(f'"""{PROSE}{sentence}"""\n')
    (tmp_path / "needle.py").write_text(f'"""{PROSE}{needle("k", "7")}"""\n')
    tests_dir = tmp_path / "test"
    tests_dir.mkdir()
    (tests_dir / "skipped.py").write_text(f'"""{PROSE}"""\n')
    assert corpus_documents(tmp_path) == [PROSE]


@pytest.mark.model
def test_contexts_are_seeded_of_the_asked_lengths_and_hold_no_evaluation_text(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    contexts = calibration_contexts(encode, 6, 100, 300, seed=3)
    assert contexts == calibration_contexts(encode, 6, 100, 300, seed=3)
    assert contexts != calibration_contexts(encode, 6, 100, 300, seed=4)
    assert all(100 <= len(ids) <= 300 for ids in contexts)
    assert len({len(ids) for ids in contexts}) > 1, "lengths are mixed"
    literals = evaluation_literals()
    for ids in contexts:
        assert not is_evaluation_text(tokenizer.decode(ids), literals)
    assert len(default_documents()) > 500, "the standard library yields a corpus"


def test_bad_lengths_are_refused() -> None:
    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        calibration_contexts(lambda text: [1], 1, 10, 5, documents=[PROSE])
