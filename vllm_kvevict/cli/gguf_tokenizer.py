"""Rebuild a catalogued model's fast tokenizer from GGUF metadata, by the GGUF's ``tokenizer.ggml.model``
(:data:`TOKENIZER_WRITERS`): ``gpt2`` (byte-level BPE) is rebuilt here, ``llama`` (SentencePiece BPE) is
transformers' own conversion, checked against SentencePiece.

Byte-level BPE: transformers' own GGUF tokenizer conversion is wrong for SmolLM2's vocabulary (eos becomes
``<|im_start|>``, a BOS is prepended, a byte-fallback decoder is used and five ids are added), so the
tokenizer is assembled here from the GGUF fields with the ``tokenizers`` library, the way the original HF
tokenizer is built: byte-level BPE, control tokens special, no BOS added, and the pre-tokenizer llama.cpp
names in ``tokenizer.ggml.pre``: ``smollm`` (digits one by one, then the GPT-2 regex) or ``qwen2`` (NFC, then
Qwen2's split regex, whose digit class also splits digits one by one).

SentencePiece BPE (Gemma 3): transformers' Gemma builder is the HF ``GemmaTokenizer`` pipeline (spaces as
``▁``, byte fallback, no prefix space), its run-of-spaces tokens respelled ``▁▁…`` and its merges rebuilt in
the GGUF's token order; it leaves out the BOS the GGUF asks for (``add_bos_token``), which is set here. The
result is checked token for token against Google's ``sentencepiece`` run on the same pieces and scores.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# llama.cpp token types (gguf.TokenType). USER_DEFINED tokens (Qwen's ``<tool_call>``) are added tokens
# that are not special; UNUSED ones (Qwen's ``[PAD151665]`` …, the embedding's padding rows) stay plain
# vocabulary entries that no merge produces, so every id keeps its GGUF position.
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_NAMES = {TOKEN_TYPE_NORMAL: "normal", TOKEN_TYPE_CONTROL: "control",
                    TOKEN_TYPE_USER_DEFINED: "user-defined", TOKEN_TYPE_UNUSED: "unused"}
# Qwen2's split regex, as its HF tokenizer.json and llama.cpp's "qwen2" pre-tokenizer have it.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = ("smollm", "qwen2")


class GGUFTokenizerError(ValueError):
    """The GGUF metadata does not describe a tokenizer this module can rebuild."""


def read_tokenizer_metadata(
    gguf_path: Path, pre_tokenizer: str, tokenizer_model: str = "gpt2"
) -> dict[str, Any]:
    """Read the ``tokenizer.*`` fields of a GGUF file into plain Python values; check the tokenizer model is
    ``tokenizer_model`` and, where the GGUF names one, that its pre-tokenizer is ``pre_tokenizer``."""
    from gguf import GGUFReader

    if tokenizer_model not in SUPPORTED_TOKENIZER_MODELS:
        supported = ", ".join(SUPPORTED_TOKENIZER_MODELS)
        raise GGUFTokenizerError(
            f"tokenizer model {tokenizer_model!r} is not handled; supported: {supported}"
        )
    fields = GGUFReader(str(gguf_path)).fields
    metadata = {name: field.contents() for name, field in fields.items() if name.startswith("tokenizer.")}
    model = metadata.get("tokenizer.ggml.model")
    if model != tokenizer_model:
        raise GGUFTokenizerError(
            f"{gguf_path}: tokenizer.ggml.model is {model!r}, expected {tokenizer_model!r}"
        )
    named = metadata.get("tokenizer.ggml.pre")
    if named is not None and named != pre_tokenizer:
        raise GGUFTokenizerError(f"{gguf_path}: tokenizer.ggml.pre is {named!r}, expected {pre_tokenizer!r}")
    return metadata


def build_tokenizer(
    tokens: list[str], token_types: list[int], merges: list[str], pre_tokenizer: str = "smollm"
) -> Tokenizer:
    """Byte-level BPE tokenizer: ``tokens[i]`` has id ``i``; CONTROL tokens become special added tokens,
    USER_DEFINED ones added tokens that are not special."""
    if pre_tokenizer not in PRE_TOKENIZERS:
        valid = ", ".join(PRE_TOKENIZERS)
        raise GGUFTokenizerError(f"pre-tokenizer {pre_tokenizer!r} is not handled; valid: {valid}")
    if len(tokens) != len(token_types):
        raise GGUFTokenizerError(f"{len(tokens)} tokens but {len(token_types)} token types")
    unknown_types = sorted(set(token_types) - set(TOKEN_TYPE_NAMES))
    if unknown_types:
        valid = ", ".join(f"{kind} ({name})" for kind, name in TOKEN_TYPE_NAMES.items())
        raise GGUFTokenizerError(f"token types {unknown_types} are not handled; valid: {valid}")
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GGUFTokenizerError("the GGUF vocabulary has duplicate tokens")
    merge_pairs = []
    for merge in merges:
        pair = merge.split(" ")
        if len(pair) != 2:
            raise GGUFTokenizerError(f"merge {merge!r} is not two space-separated symbols")
        merge_pairs.append((pair[0], pair[1]))

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False))
    if pre_tokenizer == "smollm":
        # Digits one by one, then the GPT-2 regex: as llama.cpp's "smollm" pre-tokenizer and the HF one.
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ])
        tokenizer.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
        # Offsets only; it adds no BOS/EOS (the GGUF says add_bos_token = False).
        tokenizer.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False,
                                                        use_regex=True)
    else:
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ])
        tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
        tokenizer.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                        use_regex=False)

    def added(kind: int) -> list[AddedToken]:
        special = kind == TOKEN_TYPE_CONTROL
        return [AddedToken(tokens[i], special=special, normalized=False, single_word=False, lstrip=False,
                           rstrip=False) for i, found in enumerate(token_types) if found == kind]

    tokenizer.add_special_tokens(added(TOKEN_TYPE_CONTROL))
    tokenizer.add_tokens(added(TOKEN_TYPE_USER_DEFINED))
    return tokenizer


def tokenizer_config(metadata: dict[str, Any], model_max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` content: special tokens by the GGUF ids, chat template, no BOS added."""
    tokens = metadata["tokenizer.ggml.tokens"]
    token_types = metadata["tokenizer.ggml.token_type"]

    def token_at(field: str) -> str | None:
        return tokens[int(metadata[field])] if field in metadata else None  # Qwen's GGUF names no unk

    control = [tokens[i] for i, kind in enumerate(token_types) if kind == TOKEN_TYPE_CONTROL]
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_at("tokenizer.ggml.bos_token_id"),
        "eos_token": token_at("tokenizer.ggml.eos_token_id"),
        "unk_token": token_at("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_at("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "additional_special_tokens": control,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": metadata["tokenizer.chat_template"],
    }


def write_byte_level_bpe(
    gguf_path: Path, out_dir: Path, model_max_length: int, metadata: dict[str, Any], pre_tokenizer: str
) -> dict[str, Any]:
    """Write the rebuilt byte-level BPE's ``tokenizer.json``, ``tokenizer_config.json`` and
    ``special_tokens_map.json`` into ``out_dir``; return the config written."""
    tokenizer = build_tokenizer(
        list(metadata["tokenizer.ggml.tokens"]),
        [int(t) for t in metadata["tokenizer.ggml.token_type"]],
        list(metadata["tokenizer.ggml.merges"]),
        pre_tokenizer,
    )
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = tokenizer_config(metadata, model_max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special = {key: config[key] for key in ("bos_token", "eos_token", "unk_token", "pad_token")
               if config[key] is not None}
    special["additional_special_tokens"] = config["additional_special_tokens"]
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return config


def sentencepiece_processor(tokens: list[str], scores: list[float], token_types: list[int], unk_id: int):
    """Google's SentencePiece BPE over the GGUF's pieces: the independent encoder the converted tokenizer is
    checked against. Identity normalisation, no dummy prefix, byte fallback (what the GGUF says: no
    ``add_space_prefix``, ``<0x..>`` BYTE pieces); run-of-spaces pieces are spelled ``▁▁…`` as
    SentencePiece matches them after escaping spaces. llama.cpp's token types are SentencePiece's."""
    import sentencepiece
    from sentencepiece import sentencepiece_model_pb2 as spm_model

    proto = spm_model.ModelProto()
    proto.trainer_spec.model_type = spm_model.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id = unk_id
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    for token_id, (token, score, kind) in enumerate(zip(tokens, scores, token_types, strict=True)):
        piece = proto.pieces.add()
        piece.piece = "\u2581" * len(token) if token and not token.strip(" ") else token
        piece.score = score
        piece.type = spm_model.ModelProto.SentencePiece.UNKNOWN if token_id == unk_id else kind
    return sentencepiece.SentencePieceProcessor(model_proto=proto.SerializeToString())


def check_against_sentencepiece(tokenizer: Any, processor: Any, texts: tuple[str, ...]) -> None:
    """``tokenizer`` (transformers) encodes every text of ``texts`` to SentencePiece's ids, special tokens
    aside (SentencePiece does not parse control tokens out of text)."""
    for text in texts:
        ours = tokenizer(text, add_special_tokens=False)["input_ids"]
        theirs = processor.encode(text)
        if ours != theirs:
            raise GGUFTokenizerError(
                f"the converted tokenizer encodes {text!r} as {ours[:16]}, SentencePiece as {theirs[:16]}"
            )


# Texts the converted SentencePiece tokenizer must encode exactly as SentencePiece does.
SENTENCEPIECE_CHECK_TEXTS = (
    "The year 2024 had 366 days.",
    "  leading spaces, tabs\tand\nnew lines",
    "a    b\n\n\n  c   ",
    "Unicode: café, naïve, 東京, emoji 🙂 ∑ 𝔘",
    "def f(x):\n    return [x, 22, 333]\r\n\t\tpass  # done",
    "<table><tr><td>x</td></tr></table>",
    "Über 10.000 Menschen; l'été dernier, c'était fou! 日本語と中文，한국어.",
    "\x00\x01 control \x7f bytes",
)


def write_sentencepiece_bpe(
    gguf_path: Path, out_dir: Path, model_max_length: int, metadata: dict[str, Any], pre_tokenizer: str
) -> dict[str, Any]:
    """Write transformers' conversion of the GGUF's SentencePiece BPE (BOS/EOS added as the GGUF says) into
    ``out_dir``, after checking it against SentencePiece; return ``tokenizer_config.json``'s content."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tokenizer.add_bos_token = bool(metadata.get("tokenizer.ggml.add_bos_token", False))
    tokenizer.add_eos_token = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    tokenizer.model_max_length = model_max_length
    processor = sentencepiece_processor(
        list(metadata["tokenizer.ggml.tokens"]),
        [float(score) for score in metadata["tokenizer.ggml.scores"]],
        [int(kind) for kind in metadata["tokenizer.ggml.token_type"]],
        int(metadata["tokenizer.ggml.unknown_token_id"]),
    )
    check_against_sentencepiece(tokenizer, processor, SENTENCEPIECE_CHECK_TEXTS)
    tokenizer.save_pretrained(str(out_dir))
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    for local in ("is_local", "local_files_only"):  # where it was loaded from, not what it is
        config.pop(local, None)
    config.update(add_bos_token=tokenizer.add_bos_token, add_eos_token=tokenizer.add_eos_token,
                  clean_up_tokenization_spaces=False)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return config


# ``tokenizer.ggml.model`` -> the writer of that kind of tokenizer.
TOKENIZER_WRITERS = {"gpt2": write_byte_level_bpe, "llama": write_sentencepiece_bpe}
SUPPORTED_TOKENIZER_MODELS = tuple(TOKENIZER_WRITERS)


def write_tokenizer_files(
    gguf_path: Path, out_dir: Path, model_max_length: int, pre_tokenizer: str = "smollm",
    tokenizer_model: str = "gpt2",
) -> dict[str, Any]:
    """Write the tokenizer files of the GGUF's ``tokenizer_model`` into ``out_dir``; return the
    ``tokenizer_config.json`` content written."""
    metadata = read_tokenizer_metadata(gguf_path, pre_tokenizer, tokenizer_model)
    return TOKENIZER_WRITERS[tokenizer_model](gguf_path, out_dir, model_max_length, metadata, pre_tokenizer)
