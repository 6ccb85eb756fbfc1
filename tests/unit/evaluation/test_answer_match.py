"""RULER scorers on hand-made model outputs."""

from __future__ import annotations

import pytest

from vllm_kvevict.evaluation.answer_match import score, string_match_all, string_match_part


def test_match_all_is_the_fraction_of_answers_found():
    output = " 1234567, 7654321 and then something else"
    assert string_match_all(output, ["1234567", "7654321", "1111111", "2222222"]) == 0.5


def test_match_all_ignores_case():
    assert string_match_all("The cities were LISBON and oslo.", ["Lisbon", "Oslo"]) == 1.0


def test_match_all_of_a_wrong_answer_is_zero():
    assert string_match_all(" 1234568.", ["1234567"]) == 0.0


def test_match_part_is_one_when_any_answer_is_found():
    assert string_match_part("it is teal", ["red", "teal"]) == 1.0
    assert string_match_part("it is blue", ["red", "teal"]) == 0.0


def test_score_dispatches_on_the_metric():
    assert score("a b", ["a", "c"], "all") == 0.5
    assert score("a b", ["a", "c"], "part") == 1.0


def test_unknown_metric_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown metric 'exact'; valid metrics: all, part"):
        score("x", ["x"], "exact")  # type: ignore[arg-type]


def test_empty_answers_are_rejected():
    with pytest.raises(ValueError, match="at least one reference answer"):
        string_match_all("x", [])
