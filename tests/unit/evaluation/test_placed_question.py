"""The families with the question where no chat header points to it (``evaluation/tasks/placed_question.py``):
in the system message (``qsystem_``) and in a plain completion prompt before the context (``rag_``)."""

from __future__ import annotations

import pytest

from vllm_kvevict.evaluation.generate import LENGTH_TOLERANCE, generate_sample
from vllm_kvevict.evaluation.prompt_format import PromptFormat
from vllm_kvevict.evaluation.tasks import PLACED_QUESTION_TASKS, TASKS, get_task
from vllm_kvevict.evaluation.tasks.base import TaskParts
from vllm_kvevict.evaluation.tasks.placed_question import CompletionQuestionFirst, QuestionInSystem

pytestmark = pytest.mark.model

NEEDLES = [name for name in TASKS if name.startswith("niah_")]


def test_both_families_wrap_every_needle_task_and_stay_out_of_the_default_suite() -> None:
    assert list(PLACED_QUESTION_TASKS) == [f"qsystem_{n}" for n in NEEDLES] + [f"rag_{n}" for n in NEEDLES]
    assert not set(PLACED_QUESTION_TASKS) & set(TASKS)
    system, rag = get_task("qsystem_niah_multikey"), get_task("rag_niah_multikey")
    assert isinstance(system, QuestionInSystem) and isinstance(rag, CompletionQuestionFirst)
    assert system.inner is rag.inner is TASKS["niah_multikey"]
    assert (rag.metric, rag.max_new_tokens) == (rag.inner.metric, rag.inner.max_new_tokens)


def test_a_layout_outside_the_four_is_refused() -> None:
    with pytest.raises(ValueError, match="layout 'question_middle' is not valid; valid: question_last, "):
        TaskParts("i", "c", "q", "", ("a",), layout="question_middle")  # type: ignore[arg-type]


def _question_and_key(task: str, sample) -> tuple[str, str]:
    question = get_task(task).build(sample.seed, 64, sample.target_tokens).question
    return question, question.split(" for ", 1)[1].split(" mentioned")[0]


def test_qsystem_asks_in_the_system_message_and_the_last_user_turn_is_the_document(
    prompt_format: PromptFormat,
) -> None:
    task = "qsystem_niah_single_essay"
    sample = generate_sample(get_task(task), prompt_format, 2048, seed=0, index=0)
    assert 2048 - LENGTH_TOLERANCE <= sample.prompt_tokens <= 2048
    question, key = _question_and_key(task, sample)
    system_start = sample.prompt.index("<|im_start|>system\n")
    user_start = sample.prompt.rindex("<|im_start|>user\n")
    assert system_start < sample.prompt.index(question) < user_start  # asked in the system message only
    assert sample.prompt.count(question) == 1
    for answer in sample.answers:
        assert sample.prompt.count(answer) == 1 and sample.prompt.index(answer) > user_start
    tail = prompt_format.decode(list(sample.token_ids[sample.context_tokens :]))
    assert key not in tail and tail.endswith("<|im_start|>assistant\n")


def test_rag_is_a_plain_completion_with_the_question_before_the_context(prompt_format: PromptFormat) -> None:
    task = "rag_niah_multivalue"
    sample = generate_sample(get_task(task), prompt_format, 2048, seed=0, index=0)
    assert 2048 - LENGTH_TOLERANCE <= sample.prompt_tokens <= 2048
    assert "<|im_start|>" not in sample.prompt  # no chat template, so no header for an echo to find
    question, key = _question_and_key(task, sample)
    assert sample.prompt.index(f"Question: {question}") < sample.prompt.index("Context:\n")
    context_start = sample.prompt.index("Context:")
    for answer in sample.answers:
        assert sample.prompt.count(answer) == 1 and sample.prompt.index(answer) > context_start
    tail = prompt_format.decode(list(sample.token_ids[sample.context_tokens :]))
    assert tail.strip() == "Answer:" and key not in tail


@pytest.mark.parametrize("family", ["qsystem_", "rag_"])
def test_each_family_hides_the_same_needle_as_the_question_last_task(
    prompt_format: PromptFormat, family: str
) -> None:
    last = generate_sample(get_task("niah_single_noise"), prompt_format, 1024, seed=3, index=1)
    placed = generate_sample(get_task(f"{family}niah_single_noise"), prompt_format, 1024, seed=3, index=1)
    assert placed.answers == last.answers and placed.seed == last.seed
    assert placed.id == f"{family}niah_single_noise-1024-1"
