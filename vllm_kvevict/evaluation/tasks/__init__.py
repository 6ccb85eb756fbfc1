"""Registry of the evaluation tasks: RULER's synthetic families plus few-shot pattern and summary recall
(``TASKS``, the default suite), and the needle tasks with the question before the document
(``QUESTION_FIRST_TASKS``, ``qfirst_<task>``), in the system message (``qsystem_<task>``) and in a plain
completion prompt (``rag_<task>``), named explicitly."""

from __future__ import annotations

from vllm_kvevict.evaluation.tasks.base import Metric, Task, TaskParts
from vllm_kvevict.evaluation.tasks.few_shot import FewShotPattern
from vllm_kvevict.evaluation.tasks.niah_multi import MultiKey, MultiQuery, MultiValue
from vllm_kvevict.evaluation.tasks.niah_single import SingleNeedle
from vllm_kvevict.evaluation.tasks.placed_question import CompletionQuestionFirst, QuestionInSystem
from vllm_kvevict.evaluation.tasks.question_first import QuestionFirst
from vllm_kvevict.evaluation.tasks.summary_recall import SummaryRecall
from vllm_kvevict.evaluation.tasks.variable_tracking import VariableTracking
from vllm_kvevict.evaluation.tasks.word_frequency import CommonWords, FrequentWords

_ALL: tuple[Task, ...] = (
    SingleNeedle("noise"),
    SingleNeedle("essay"),
    SingleNeedle("digits"),
    MultiKey(),
    MultiKey(hard=True),
    MultiValue(),
    MultiQuery(),
    VariableTracking(),
    CommonWords(),
    FrequentWords(),
    FewShotPattern(),
    SummaryRecall(),
)
TASKS: dict[str, Task] = {task.name: task for task in _ALL}
#: The needle tasks with the question before the document; not in the default suite.
QUESTION_FIRST_TASKS: dict[str, Task] = {
    wrapped.name: wrapped for wrapped in (QuestionFirst(t) for t in _ALL if t.name.startswith("niah_"))
}
#: The needle tasks with the question where no chat header points to it: in the system message
#: (``qsystem_<task>``) and in a plain completion prompt before the context (``rag_<task>``).
PLACED_QUESTION_TASKS: dict[str, Task] = {
    wrapped.name: wrapped
    for family in (QuestionInSystem, CompletionQuestionFirst)
    for wrapped in (family(t) for t in _ALL if t.name.startswith("niah_"))
}
ALL_TASKS: dict[str, Task] = {**TASKS, **QUESTION_FIRST_TASKS, **PLACED_QUESTION_TASKS}


def get_task(name: str) -> Task:
    """The task called ``name`` (default suite or question-first family), or a ValueError listing them."""
    if name not in ALL_TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(ALL_TASKS)}")
    return ALL_TASKS[name]


__all__ = [
    "ALL_TASKS",
    "PLACED_QUESTION_TASKS",
    "QUESTION_FIRST_TASKS",
    "TASKS",
    "Metric",
    "Task",
    "TaskParts",
    "get_task",
]
