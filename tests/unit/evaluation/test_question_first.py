"""The question-first family (``evaluation/tasks/question_first.py``): the needle tasks with the instruction
and question before the document, the same needles as the question-last tasks."""

from __future__ import annotations

import pytest

from vllm_kvevict.evaluation.generate import LENGTH_TOLERANCE, generate_sample
from vllm_kvevict.evaluation.prompt_format import PromptFormat
from vllm_kvevict.evaluation.tasks import QUESTION_FIRST_TASKS, TASKS, get_task
from vllm_kvevict.evaluation.tasks.question_first import ANSWER_PREFIX, QuestionFirst

pytestmark = pytest.mark.model


def test_the_family_wraps_every_needle_task_and_stays_out_of_the_default_suite() -> None:
    needles = [name for name in TASKS if name.startswith("niah_")]
    assert list(QUESTION_FIRST_TASKS) == [f"qfirst_{name}" for name in needles]
    assert not set(QUESTION_FIRST_TASKS) & set(TASKS)
    task = get_task("qfirst_niah_multikey")
    assert isinstance(task, QuestionFirst) and task.inner is TASKS["niah_multikey"]
    assert (task.metric, task.max_new_tokens) == (task.inner.metric, task.inner.max_new_tokens)
    with pytest.raises(ValueError, match="qfirst_niah_single_essay"):
        get_task("qfirst_cwe")


@pytest.mark.parametrize("task", ["qfirst_niah_single_essay", "qfirst_niah_multivalue"])
def test_the_question_comes_before_the_needles_and_the_prompt_ends_in_document_text(
    prompt_format: PromptFormat, task: str
) -> None:
    sample = generate_sample(get_task(task), prompt_format, 2048, seed=0, index=0)
    assert 2048 - LENGTH_TOLERANCE <= sample.prompt_tokens <= 2048
    question = get_task(task).build(sample.seed, 64, 2048).question
    key = question.split(" for ", 1)[1].split(" mentioned")[0]
    asked_at = sample.prompt.index(question)
    for answer in sample.answers:
        assert sample.prompt.count(answer) == 1 and sample.prompt.index(answer) > asked_at
    tail = prompt_format.decode(list(sample.token_ids[sample.context_tokens :]))
    assert key not in tail and question not in tail
    assert ANSWER_PREFIX == "" and tail.endswith("<|im_start|>assistant\n")  # the turn starts empty
    context = prompt_format.decode(list(sample.token_ids[: sample.context_tokens]))
    assert context.count(key) == 1 + len(sample.answers)  # once asked, once in each of its needles


def test_a_question_first_sample_hides_the_same_needle_as_the_question_last_one(
    prompt_format: PromptFormat,
) -> None:
    last = generate_sample(get_task("niah_single_noise"), prompt_format, 1024, seed=3, index=1)
    first = generate_sample(get_task("qfirst_niah_single_noise"), prompt_format, 1024, seed=3, index=1)
    assert first.answers == last.answers and first.seed == last.seed
    assert first.id == "qfirst_niah_single_noise-1024-1"
    assert first.prompt != last.prompt
