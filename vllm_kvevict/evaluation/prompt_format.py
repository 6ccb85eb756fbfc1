"""The served model's prompt format: its chat template and tokenizer turn a task's parts into exact prompts.

Prompts are sent as text to the completions endpoint, rendered here with the model's own chat template (or,
for the plain-completion layout, without one) and followed by the task's answer prefix (as RULER does), so
the token count measured here is the one the server sees (``usage.prompt_tokens``; the end-to-end test
checks that they agree).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_kvevict.evaluation.tasks.base import TaskParts


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt ready to send, and where its compressible context ends (for question-agnostic runs)."""

    text: str
    token_ids: tuple[int, ...]
    context_tokens: int
    """Tokens up to the end of the context; the rest is the question, the template's tail, the prefix."""


class PromptFormat:
    """Renders :class:`TaskParts` with a tokenizer's chat template and counts the tokens of the result."""

    def __init__(self, tokenizer: Any) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                "the tokenizer has no chat template; pass the served model's tokenizer directory"
            )
        self._tokenizer = tokenizer

    @classmethod
    def from_path(cls, path: str | Path) -> PromptFormat:
        """Load the tokenizer (``tokenizer.json`` + ``tokenizer_config.json``) of a model directory."""
        from transformers import AutoTokenizer

        directory = Path(path)
        if (
            not (directory / "tokenizer_config.json").is_file()
            and not (directory / "tokenizer.json").is_file()
        ):
            raise FileNotFoundError(f"no tokenizer files in {directory} (expected tokenizer.json)")
        # model_max_length: the search renders prompts past the target; silence transformers' length warning.
        return cls(AutoTokenizer.from_pretrained(str(directory), model_max_length=10**9))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as a completions endpoint tokenizes it (with the special tokens it adds)."""
        return list(self._tokenizer(text, add_special_tokens=True)["input_ids"])

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids``, special tokens included (so that ``encode(decode(ids)) == ids``)."""
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=False))

    def render_text(self, parts: TaskParts) -> tuple[str, int]:
        """The prompt text of ``parts`` and the character offset where its context ends."""
        if parts.layout == "completion_question_first":
            head = f"{parts.instruction}\n\nQuestion: {parts.question}\n\nContext:\n{parts.context}"
            return f"{head}\n\nAnswer:{parts.answer_prefix}", len(head)
        if parts.layout == "question_in_system":
            messages = [
                {"role": "system", "content": f"{parts.instruction}\n\n{parts.question}"},
                {"role": "user", "content": parts.context},
            ]
            head = user = parts.context
        elif parts.layout == "question_first":
            head = user = f"{parts.instruction}\n\n{parts.question}\n\n{parts.context}"
            messages = [{"role": "user", "content": user}]
        else:
            head = f"{parts.instruction}\n\n{parts.context}"
            user = f"{head}\n\n{parts.question}"
            messages = [{"role": "user", "content": user}]
        chat = self._tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        start = chat.rfind(user)
        if start < 0:
            raise ValueError("the chat template altered the user message; cannot locate the context in it")
        return chat + parts.answer_prefix, start + len(head)

    def count(self, parts: TaskParts) -> int:
        """Prompt tokens of ``parts`` once rendered."""
        return len(self.encode(self.render_text(parts)[0]))

    def render(self, parts: TaskParts) -> RenderedPrompt:
        """Render ``parts`` and locate the context's last token."""
        text, context_end = self.render_text(parts)
        encoding = self._tokenizer(text, add_special_tokens=True, return_offsets_mapping=True)
        ids = list(encoding["input_ids"])
        context_tokens = sum(1 for _, end in encoding["offset_mapping"] if end <= context_end)
        return RenderedPrompt(text=text, token_ids=tuple(ids), context_tokens=context_tokens)
