"""Registry of the evaluation tasks: RULER's synthetic families plus few-shot pattern and summary recall."""

from __future__ import annotations

from vllm_kvevict.evaluation.tasks.base import Metric, Task, TaskParts
from vllm_kvevict.evaluation.tasks.few_shot import FewShotPattern
from vllm_kvevict.evaluation.tasks.niah_multi import MultiKey, MultiQuery, MultiValue
from vllm_kvevict.evaluation.tasks.niah_single import SingleNeedle
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


def get_task(name: str) -> Task:
    """The task called ``name``, or a ValueError listing the valid names."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(TASKS)}")
    return TASKS[name]


__all__ = ["TASKS", "Metric", "Task", "TaskParts", "get_task"]
