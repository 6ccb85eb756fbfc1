"""Our kept token sets equal kvpress 0.5.5's for the six methods both implement, on identical tensors.

Configuration: our policies are set to kvpress's defaults (window 64, average pooling, kernel 5; sinks 4,
Ada alpha 0.2, CriticalKV first-stage ratio 0.5 and epsilon 1e-4 are already the same). Budgets are
kvpress's ``int(n * (1 - compression_ratio))`` per head, with ratios that make ``n * (1 - ratio)`` an
integer (PyramidKVPress feeds the float into its layer formula). kvpress runs in ``.venv-ref`` on the same
float32 tensors (``scripts/kvpress_reference/kept_indices.py``).

One known difference, outside these cases: when a CriticalKV first stage (``first_stage_ratio * B``) is
smaller than the window, kvpress picks part of the window by an arbitrary top-k among its equal scores
and lets the rest compete in stage 2, so it can drop window tokens; we always keep the whole window.
The budgets here keep stage 1 at least as large as the window.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvpress_runner import (
    EXPECTED_EPSILON,
    EXPECTED_METHODS,
    SHARED_METHODS,
    case_dict,
    expected_case,
    method_params,
    our_kept,
    run_kvpress,
)
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from vllm_kvevict.hf_reference import capture_layers, load_reference_model
from vllm_kvevict.hf_reference.model import attention_modules
from vllm_kvevict.policies.base import LayerKV
from vllm_kvevict.policies.query_statistics import rope_cos_sin

pytestmark = [pytest.mark.reference, pytest.mark.model]

#: (case, compression ratios). n is a multiple of 8 so n * (1 - ratio) is exact.
RANDOM_N = 2560  # large enough that PyramidKV's default beta = 20 gives a real pyramid at ratio 0.5
REAL_N = 512
RATIOS = (0.5, 0.75)
#: PyramidKV at beta 2 makes a pyramid (not the uniform fallback) on the 512-token real prompt.
PYRAMID_STEEP = {"beta": 2}


def jobs_for(ratios: tuple[float, ...]) -> list[dict]:
    jobs = [
        {"key": f"{method}@{ratio}", "press": method, "compression_ratio": ratio, "params": {}}
        for method in SHARED_METHODS
        for ratio in ratios
    ]
    jobs += [
        {
            "key": f"pyramidkv-beta2@{ratio}",
            "press": "pyramidkv",
            "compression_ratio": ratio,
            "params": PYRAMID_STEEP,
        }
        for ratio in ratios
    ]
    return jobs


def random_layers(n: int, seed: int = 0) -> list[LayerKV]:
    """Three layers of a 30-layer model (first, middle, last: PyramidKV budgets differ) with Llama-like
    shapes: 3 KV heads, 9 query heads, head_dim 64, hidden 576."""
    generator = torch.Generator().manual_seed(seed)
    layers = []
    for layer_idx in (0, 14, 29):
        layers.append(
            LayerKV(
                keys=torch.randn(3, n, 64, generator=generator),
                values=torch.randn(3, n, 64, generator=generator),
                queries=torch.randn(9, 64, 64, generator=generator) * 0.5,
                layer_idx=layer_idx,
                num_layers=30,
                o_proj=torch.randn(576, 576, generator=generator) * 0.05,
            )
        )
    return layers


def hand_layers() -> list[LayerKV]:
    """Two KV heads with one query head each, 8 tokens, d 4, window 2 (tokens 6, 7, zero keys).

    Both window queries are e0, so a token's score orders like its key's first coordinate: head 0 has
    10 on token 1, head 1 has 10 on tokens 1, 2, 3; the other tokens get small distinct values
    (0.05, 0.25, 0.35, 0.45, 0.55 on tokens 0, 2, 3, 4, 5 where not strong), so no ties decide anything.
    The second coordinate (unseen by the queries) only makes every key row distinct.
    """
    small = {0: 0.05, 2: 0.25, 3: 0.35, 4: 0.45, 5: 0.55}
    keys = torch.zeros(2, 8, 4)
    for token, value in small.items():
        keys[:, token, 0] = value
    keys[0, 1, 0] = 10.0
    keys[1, 1:4, 0] = 10.0
    keys[:, :, 1] = torch.arange(8) / 10
    queries = torch.zeros(2, 2, 4)
    queries[:, :, 0] = 1.0
    values = torch.arange(2 * 8 * 4, dtype=torch.float32).reshape(2, 8, 4) / 64
    return [LayerKV(keys=keys, values=values, queries=queries, o_proj=torch.eye(8))]


#: Kept sets worked out by hand for ``hand_layers`` at compression ratio 0.5 (4 of 8 per head on average).
HAND_EXPECTED = {
    # Window {6, 7} + the two best: token 1 (logit 5), then token 5 (0.275). Head 1 would pick 2 of the
    # equal tokens 1-3, a tie top-k may break either way, so SnapKV is checked on head 0.
    "snapkv": {0: [1, 5, 6, 7]},
    # Sinks {0, 1} + the last two tokens, per head.
    "streamingllm": {0: [0, 1, 6, 7], 1: [0, 1, 6, 7]},
    # 8 slots for the layer: the windows take 4 (the 1-token safeguard per head is a window token); of
    # the other 4, head 0's token 1 (attention ~0.96) and head 1's tokens 1-3 (~0.33 each) beat all else.
    "ada-snapkv": {0: [1, 6, 7], 1: [1, 2, 3, 6, 7]},
}
HAND_PARAMS = {
    "snapkv": {"window": 2, "kernel": 1, "span_after": 0},
    "ada-snapkv": {"window": 2, "kernel": 1, "span_after": 0},
    "streamingllm": {"sinks": 2},
}
HAND_KVPRESS = {
    "snapkv": {"window_size": 2, "kernel_size": 1},
    "ada-snapkv": {"window_size": 2, "kernel_size": 1},
    "streamingllm": {"n_sink": 2},
}


def expected_jobs(ratios: tuple[float, ...]) -> list[dict]:
    return [
        {
            "key": f"{method}@{ratio}",
            "press": method,
            "compression_ratio": ratio,
            "params": {"epsilon": EXPECTED_EPSILON[method]},
        }
        for method in EXPECTED_METHODS
        for ratio in ratios
    ]


#: SmolLM2's RoPE base (the random case uses the real model's frequencies too).
ROPE_THETA = 100000.0


def random_expected_layers(n: int, seed: int = 1) -> tuple[list[LayerKV], list[torch.Tensor]]:
    """Layers as ``random_layers`` with all n queries: post-RoPE for us (RoPE applied by HF Llama's
    ``apply_rotary_pos_emb``), pre-RoPE for kvpress. The queries have a mean (an offset) so that the
    mean term of the expected logit matters beside the covariance."""
    generator = torch.Generator().manual_seed(seed)
    inv_freq = 1.0 / (ROPE_THETA ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    cos, sin = rope_cos_sin(inv_freq, torch.arange(n))
    layers, prerope = [], []
    for layer_idx in (0, 14, 29):
        pre = torch.randn(9, n, 64, generator=generator) * 0.5 + torch.randn(9, 1, 64, generator=generator)
        post, _ = apply_rotary_pos_emb(pre[None], pre[None], cos[None], sin[None])
        layers.append(
            LayerKV(
                keys=torch.randn(3, n, 64, generator=generator),
                values=torch.randn(3, n, 64, generator=generator),
                queries=post[0],
                layer_idx=layer_idx,
                num_layers=30,
                query_positions=torch.arange(n),
                o_proj=torch.randn(576, 576, generator=generator) * 0.05,
                rope_inv_freq=inv_freq,
            )
        )
        prerope.append(pre)
    return layers, prerope


#: Layers of the bundled model compared with kvpress (first, last and three between; all 30 would only
#: repeat the same check at five times the cost).
REAL_LAYER_INDICES = (0, 7, 14, 22, 29)


def real_prompt_ids(tokenizer) -> torch.Tensor:
    """The last ``REAL_N`` tokens of a chat prompt whose paragraph repeats, with a question at its end."""
    paragraph = (
        "The committee met on a rainy Tuesday to review the harbour accounts. The treasurer reported that "
        "the new crane cost 4,812 crowns, twice the estimate, and that the ferry tolls had fallen. "
    )
    messages = [{"role": "user", "content": paragraph * 40 + "How much did the new crane cost?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    ids = torch.tensor(ids[-REAL_N:])
    assert ids.shape[0] == REAL_N
    return ids


def layers_of(model, tokenizer, indices: tuple[int, ...]) -> list[LayerKV]:
    """Layers ``indices`` of ``model`` on the real 512-token chat prompt, captured post-RoPE (each keeps
    its true layer_idx and num_layers, which PyramidKV's budgets use)."""
    layers = capture_layers(model, real_prompt_ids(tokenizer), query_window=64)
    return [layers[idx] for idx in indices]


def expected_layers_of(
    model, tokenizer, indices: tuple[int, ...]
) -> tuple[list[LayerKV], list[torch.Tensor]]:
    """The same layers with all 512 post-RoPE queries (ours) and the q_proj outputs, i.e. the queries
    before RoPE, taken from the model itself (kvpress's)."""
    modules = attention_modules(model)
    head_dim = model.config.head_dim if getattr(model.config, "head_dim", None) else (
        model.config.hidden_size // model.config.num_attention_heads)
    prerope: dict[int, torch.Tensor] = {}
    hooks = [
        modules[idx].q_proj.register_forward_hook(
            lambda _module, _args, out, idx=idx: prerope.__setitem__(
                idx, out[0].detach().float().reshape(out.shape[1], -1, head_dim).transpose(0, 1).clone()
            )
        )
        for idx in indices
    ]
    try:
        layers = capture_layers(model, real_prompt_ids(tokenizer), query_window=None)
    finally:
        for hook in hooks:
            hook.remove()
    return [layers[idx] for idx in indices], [prerope[idx] for idx in indices]


@pytest.fixture(scope="module")
def reference_model(model_dir: Path):
    return load_reference_model(model_dir)


@pytest.fixture(scope="module")
def real_layers(reference_model) -> list[LayerKV]:
    """Layers ``REAL_LAYER_INDICES`` of the bundled model on the real prompt."""
    return layers_of(*reference_model, REAL_LAYER_INDICES)


@pytest.fixture(scope="module")
def real_expected_layers(reference_model) -> tuple[list[LayerKV], list[torch.Tensor]]:
    return expected_layers_of(*reference_model, REAL_LAYER_INDICES)


#: Qwen2.5-Coder-0.5B-Instruct (24 layers, 14 query heads on 2 KV heads: groups of 7, QKV bias): the
#: methods the issue names, on its first, last and three layers between.
QWEN_LAYER_INDICES = (0, 6, 12, 18, 23)
QWEN_METHODS = ("snapkv", "ada-snapkv")


@pytest.fixture(scope="module")
def qwen_model(qwen_model_dir: Path):
    return load_reference_model(qwen_model_dir)


@pytest.fixture(scope="module")
def qwen_layers(qwen_model) -> list[LayerKV]:
    return layers_of(*qwen_model, QWEN_LAYER_INDICES)


@pytest.fixture(scope="module")
def qwen_expected_layers(qwen_model) -> tuple[list[LayerKV], list[torch.Tensor]]:
    return expected_layers_of(*qwen_model, QWEN_LAYER_INDICES)


@pytest.fixture(scope="module")
def kvpress_kept(
    real_layers: list[LayerKV], real_expected_layers, qwen_layers, qwen_expected_layers, tmp_path_factory
) -> dict[str, dict[str, torch.Tensor]]:
    """kvpress's kept masks for the random, real and hand cases, from one ``.venv-ref`` subprocess."""
    hand_jobs = [
        {"key": method, "press": method, "compression_ratio": 0.5, "params": HAND_KVPRESS[method]}
        for method in HAND_EXPECTED
    ]
    cases = {
        "random": case_dict(random_layers(RANDOM_N), jobs_for(RATIOS)),
        "real": case_dict(real_layers, jobs_for(RATIOS)),
        "hand": case_dict(hand_layers(), hand_jobs),
        "random-expected": expected_case(*random_expected_layers(RANDOM_N), expected_jobs(RATIOS)),
        "real-expected": expected_case(*real_expected_layers, expected_jobs(RATIOS)),
        "qwen": case_dict(qwen_layers, [j for j in jobs_for(RATIOS) if j["press"] in QWEN_METHODS
                                        and not j["params"]]),
        "qwen-expected": expected_case(*qwen_expected_layers, expected_jobs(RATIOS)),
    }
    return run_kvpress(cases, tmp_path_factory.mktemp("kvpress"))


def assert_same_kept(ours: torch.Tensor, theirs: torch.Tensor, label: str) -> None:
    assert ours.shape == theirs.shape, label
    differ = (ours != theirs).nonzero().tolist()
    assert not differ, (
        f"{label}: kept sets differ at (layer, head, token) {differ[:10]} ({len(differ)} in all)"
    )


def assert_same_kept_scores(
    ours: torch.Tensor, theirs: torch.Tensor, scores: torch.Tensor, label: str
) -> None:
    """Per (layer, head) the kept scores are the same multiset: the kept sets differ only among ties."""
    assert ours.shape == theirs.shape == scores.shape, label
    for layer, head in ((i, h) for i in range(scores.shape[0]) for h in range(scores.shape[1])):
        mine, other = scores[layer, head][ours[layer, head]], scores[layer, head][theirs[layer, head]]
        assert torch.equal(mine.sort().values, other.sort().values), f"{label}: layer {layer} head {head}"


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("method", SHARED_METHODS)
def test_random_tensors_keep_the_same_tokens_as_kvpress(kvpress_kept, method: str, ratio: float) -> None:
    ours = our_kept(method, random_layers(RANDOM_N), ratio, **method_params(method))
    assert_same_kept(ours, kvpress_kept["random"][f"{method}@{ratio}"], f"random {method}@{ratio}")


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("method", SHARED_METHODS)
def test_real_model_tensors_keep_the_same_tokens_as_kvpress(
    kvpress_kept, real_layers: list[LayerKV], method: str, ratio: float
) -> None:
    ours = our_kept(method, real_layers, ratio, **method_params(method))
    theirs = kvpress_kept["real"][f"{method}@{ratio}"]
    if method == "knorm":
        # RoPE keeps a key's norm, so in layer 0 every repeat of a token has the same norm: top-k may keep
        # either of two equal scores. The kept norms must be the same, whichever tokens carry them.
        norms = torch.stack([layer.keys.norm(dim=-1) for layer in real_layers])  # [layers, kv_heads, n]
        assert_same_kept_scores(ours, theirs, norms, f"real {method}@{ratio}")
        return
    assert_same_kept(ours, theirs, f"real {method}@{ratio}")


@pytest.mark.parametrize("ratio", RATIOS)
def test_steep_pyramid_layer_budgets_match_kvpress(
    kvpress_kept, real_layers: list[LayerKV], ratio: float
) -> None:
    ours = our_kept("pyramidkv", real_layers, ratio, **method_params("pyramidkv", PYRAMID_STEEP))
    theirs = kvpress_kept["real"][f"pyramidkv-beta2@{ratio}"]
    per_layer = theirs[:, 0].sum(dim=-1)
    assert per_layer[0] > per_layer[-1], "beta=2 must give a real pyramid, not the uniform fallback"
    assert_same_kept(ours, theirs, f"real pyramidkv beta=2 @{ratio}")


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("method", EXPECTED_METHODS)
def test_expected_attention_keeps_the_same_tokens_as_kvpress(
    kvpress_kept, real_expected_layers, method: str, ratio: float
) -> None:
    """Ours un-rotates the post-RoPE queries it is given; kvpress reads the queries before RoPE (random:
    the tensors RoPE was applied to; real: the model's q_proj outputs)."""
    cases = {"random": random_expected_layers(RANDOM_N)[0], "real": real_expected_layers[0]}
    for case, layers in cases.items():
        ours = our_kept(method, layers, ratio, **method_params(method))
        assert_same_kept(
            ours, kvpress_kept[f"{case}-expected"][f"{method}@{ratio}"], f"{case} {method}@{ratio}"
        )


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("method", QWEN_METHODS + EXPECTED_METHODS)
def test_qwen2_gqa7_tensors_keep_the_same_tokens_as_kvpress(
    kvpress_kept, qwen_layers, qwen_expected_layers, method: str, ratio: float
) -> None:
    """The real Qwen2.5-Coder-0.5B (GQA groups of 7): the group mean, Ada-KV's allocation over its two
    heads and the Expected Attention statistics keep kvpress's tokens."""
    expected = method in EXPECTED_METHODS
    layers = qwen_expected_layers[0] if expected else qwen_layers
    ours = our_kept(method, layers, ratio, **method_params(method))
    theirs = kvpress_kept["qwen-expected" if expected else "qwen"][f"{method}@{ratio}"]
    assert ours.shape[1] == 2
    assert_same_kept(ours, theirs, f"qwen {method}@{ratio}")


@pytest.mark.parametrize("method", sorted(HAND_EXPECTED))
def test_hand_checked_case_matches_kvpress_and_the_worked_answer(kvpress_kept, method: str) -> None:
    ours = our_kept(method, hand_layers(), 0.5, **HAND_PARAMS[method])[0]
    theirs = kvpress_kept["hand"][method][0]
    for head, expected in HAND_EXPECTED[method].items():
        assert ours[head].nonzero().flatten().tolist() == expected, f"ours, head {head}"
        assert theirs[head].nonzero().flatten().tolist() == expected, f"kvpress, head {head}"


def test_hand_checked_tie_is_the_only_snapkv_difference(kvpress_kept) -> None:
    """Head 1 has three equal best tokens (1, 2, 3) for two slots: we take the lower indices, kvpress's
    torch.topk may take any two. Both keep the window and two of the tied tokens."""
    ours = our_kept("snapkv", hand_layers(), 0.5, **HAND_PARAMS["snapkv"])[0, 1]
    theirs = kvpress_kept["hand"]["snapkv"][0, 1]
    assert ours.nonzero().flatten().tolist() == [1, 2, 6, 7]
    kept = set(theirs.nonzero().flatten().tolist())
    assert len(kept) == 4 and {6, 7} <= kept and len(kept & {1, 2, 3}) == 2
