"""Generated samples: exact lengths, answers planted exactly once, determinism by seed."""

from __future__ import annotations

import pytest

from vllm_kvevict.evaluation.generate import LENGTH_TOLERANCE, generate_sample, generate_samples
from vllm_kvevict.evaluation.prompt_format import PromptFormat
from vllm_kvevict.evaluation.tasks import TASKS, get_task
from vllm_kvevict.evaluation.tasks.word_frequency import zipf_counts

pytestmark = pytest.mark.model

NEEDLE_TASKS = [name for name in TASKS if name.startswith("niah_")]


@pytest.mark.parametrize("length", [1024, 2500])
@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_length_is_within_tolerance_below_target(prompt_format: PromptFormat, task: str, length: int):
    sample = generate_sample(get_task(task), prompt_format, length, seed=0, index=0)
    assert length - LENGTH_TOLERANCE <= sample.prompt_tokens <= length
    assert sample.prompt_tokens == len(prompt_format.encode(sample.prompt)) == len(sample.token_ids)


@pytest.mark.parametrize("task", NEEDLE_TASKS + ["summary_recall"])
def test_every_answer_is_in_the_context_exactly_once(prompt_format: PromptFormat, task: str):
    for index in range(3):
        sample = generate_sample(get_task(task), prompt_format, 2048, seed=7, index=index)
        context = prompt_format.decode(list(sample.token_ids[: sample.context_tokens]))
        question = prompt_format.decode(list(sample.token_ids[sample.context_tokens :]))
        for answer in sample.answers:
            assert context.count(answer) == 1, (sample.id, answer)
            assert answer not in question


def test_variable_tracking_value_is_planted_once_and_every_name_is_assigned(prompt_format: PromptFormat):
    sample = generate_sample(get_task("vt"), prompt_format, 2048, seed=3, index=0)
    for name in sample.answers:
        assert sample.prompt.count(f"VAR {name} = ") == 1


def test_common_words_are_the_most_frequent_entries(prompt_format: PromptFormat):
    sample = generate_sample(get_task("cwe"), prompt_format, 2048, seed=1, index=0)
    words = prompt_format.decode(list(sample.token_ids[: sample.context_tokens])).split("\n\n")[-1].split()
    counts = {w: words.count(w) for w in set(words)}
    top = sorted(counts, key=counts.get, reverse=True)[: len(sample.answers)]
    assert set(top) == set(sample.answers)
    others = [c for w, c in counts.items() if w not in sample.answers]
    assert min(counts[w] for w in sample.answers) > max(others)


def test_zipf_counts_add_up_and_have_a_strict_top_three():
    counts = zipf_counts(500)
    assert sum(counts) == 500
    assert counts[0] > counts[1] > counts[2] > counts[3]


def test_fewshot_asked_word_never_appears_in_the_examples(prompt_format: PromptFormat):
    for index in range(3):
        sample = generate_sample(get_task("fewshot_pattern"), prompt_format, 1024, seed=0, index=index)
        asked = sample.prompt.rsplit("\n", 1)[-1].split(" =>")[0]
        examples = prompt_format.decode(list(sample.token_ids[: sample.context_tokens])).split("\n\n")[-1]
        assert asked not in [line.split(" => ")[0] for line in examples.splitlines()]
        assert f"=> {sample.answers[0]}" in examples


def test_same_seed_gives_the_same_samples_and_another_seed_differs(prompt_format: PromptFormat):
    first = generate_samples(["niah_single_essay", "cwe"], [1024], 2, seed=11, fmt=prompt_format)
    again = generate_samples(["niah_single_essay", "cwe"], [1024], 2, seed=11, fmt=prompt_format)
    other = generate_samples(["niah_single_essay", "cwe"], [1024], 2, seed=12, fmt=prompt_format)
    assert first == again
    assert [s.prompt for s in first] != [s.prompt for s in other]
    assert len({s.prompt for s in first}) == len(first)


def test_context_tokens_end_before_the_question(prompt_format: PromptFormat):
    sample = generate_sample(get_task("niah_single_noise"), prompt_format, 1024, seed=0, index=0)
    tail = prompt_format.decode(list(sample.token_ids[sample.context_tokens :]))
    assert tail.lstrip().startswith("What is the special magic number")
    context_ids = list(sample.token_ids[: sample.context_tokens])
    assert prompt_format.encode(prompt_format.decode(context_ids)) == context_ids


def test_target_below_the_shortest_prompt_is_rejected_with_the_numbers(prompt_format: PromptFormat):
    with pytest.raises(ValueError, match="target of 100 tokens is below"):
        generate_sample(get_task("niah_single_noise"), prompt_format, 100, seed=0, index=0)


def test_unknown_task_names_the_valid_ones():
    with pytest.raises(ValueError, match="unknown task 'niah'.*niah_single_noise"):
        get_task("niah")
