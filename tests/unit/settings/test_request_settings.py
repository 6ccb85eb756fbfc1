"""Per-request settings (``vllm_xargs`` -> ``SamplingParams.extra_args``): validation with errors that
name the bad value and the valid ones, vLLM's own validator path, and the scheduler and the worker agreeing
on every request's plan without a message."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.exceptions import VLLMValidationError
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
from vllm.v1.sample.logits_processor import validate_logits_processors_parameters

from vllm_kvevict.datapath.worker import EvictionWorker, StepInputs
from vllm_kvevict.settings.config import EvictionConfig
from vllm_kvevict.settings.parsers import EvictionConfigError
from vllm_kvevict.settings.request_override import RequestOverride, parse_override
from vllm_kvevict.settings.request_settings import RequestSettings
from vllm_kvevict.vllm_adapter import vllm_patches
from vllm_kvevict.vllm_adapter.evicting_kv_manager import register_evicting_spec
from vllm_kvevict.vllm_adapter.kv_spec import EvictingAttentionSpec
from vllm_kvevict.vllm_adapter.request_validation import (
    SERVER_CONFIG_ENV,
    VALIDATOR_FQCN,
    VllmXargsMiddleware,
    publish_server_config,
)

SERVER = EvictionConfig("ada-snapkv", 64, {"window": 8})
HEADS, GROUP, DIM, BS, LAYERS = 3, 3, 16, 32, 4


@pytest.mark.parametrize(
    ("extra_args", "expected"),
    [
        (None, None),
        ({"session_id": "x"}, None),  # other extensions' keys are not ours
        ({"kv_budget": 0.1}, RequestOverride("ada-snapkv", 0.1)),
        ({"kv_budget": 256}, RequestOverride("ada-snapkv", 256)),
        ({"kv_eviction": "snapkv"}, RequestOverride("snapkv", 64)),
        ({"kv_eviction": "streamingllm", "kv_budget": 0.5}, RequestOverride("streamingllm", 0.5)),
        ({"kv_eviction": "none"}, RequestOverride("none", None)),
        ({"kv_prefill": "chunked"}, RequestOverride("ada-snapkv", 64, prefill="chunked")),
        ({"kv_eviction": "snapkv", "kv_prefill": "whole"}, RequestOverride("snapkv", 64, prefill="whole")),
        ({"kv_eviction": "knorm", "kv_context": "keep"}, RequestOverride("knorm", 64, context=True)),
        ({"kv_question_echo": 0}, RequestOverride("ada-snapkv", 64, question_echo=0)),
        ({"kv_question_echo": 16}, RequestOverride("ada-snapkv", 64, question_echo=16)),
        ({"kv_eviction": "h2o", "kv_question_echo": 0}, RequestOverride("h2o", 64, question_echo=0)),
    ],
)
def test_valid_overrides(extra_args, expected):
    assert parse_override(extra_args, SERVER) == expected


@pytest.mark.parametrize(
    ("extra_args", "message"),
    [
        ({"kv_eviction": "bogus"}, "kv_eviction='bogus' is not a known method; valid: none, snapkv,"),
        ({"kv_eviction": 3}, "kv_eviction=3 is not a known method; valid: none"),
        ({"kv_budget": 0}, "kv_budget=0 is out of range; valid: an integer >= 1"),
        ({"kv_budget": -5}, "kv_budget=-5 is out of range"),
        ({"kv_budget": 1.0}, "kv_budget=1.0 is out of range; valid: an integer >= 1 (kept tokens per KV "
         "head) or a float in (0, 1)"),
        ({"kv_budget": 2.5}, "kv_budget=2.5 is out of range"),
        ({"kv_budget": "128"}, "kv_budget='128' is a string, not a number"),
        ({"kv_budget": [1, 2]}, "kv_budget=[1, 2] is a list, not a number"),
        ({"kv_budget": 4}, "kv_budget=4 is below the 8 tokens ada-snapkv always keeps (its window/sinks); "
         "valid: an integer >= 8"),
        ({"kv_eviction": "snapkv", "kv_budget": 16}, "kv_budget=16 is below the 32 tokens snapkv"),  # default
        ({"kv_eviction": "critical-snapkv"}, "'critical-snapkv' cannot run per request on this server: it "
         "needs the o_proj weights"),
        ({"kv_eviction": "none", "kv_budget": 0.2}, "with kv_eviction='none'"),
        ({"kv_eviction": "none", "kv_prefill": "chunked"}, "kv_prefill='chunked' with kv_eviction='none'"),
        ({"kv_prefill": "streamed"}, "kv_prefill='streamed' is not valid; valid: chunked, whole"),
        ({"kv_prefill": True}, "kv_prefill=True is not valid; valid: chunked, whole"),
        ({"kv_eviction": "snapkv", "kv_context": "share"}, "kv_context='share' is not valid; valid: keep"),
        ({"kv_eviction": "ada-pyramidkv", "kv_context": "keep"}, "kv_context='keep' with "
         "kv_eviction='ada-pyramidkv': a kept context needs a method whose heads keep whole blocks and one "
         "budget per layer; valid: "),
        ({"kv_eviction": "none", "kv_context": "keep"}, "kv_context='keep' with kv_eviction='none'"),
        ({"kv_eviction": "snapkv", "kv_context": "keep", "kv_prefill": "chunked"}, "set kv_prefill='whole'"),
        ({"kv_question_echo": -1}, "kv_question_echo=-1 is not valid; valid: an integer >= 0"),
        ({"kv_question_echo": "32"}, "kv_question_echo='32' is not valid; valid: an integer >= 0"),
        ({"kv_question_echo": True}, "kv_question_echo=True is not valid"),
        ({"kv_eviction": "streamingllm", "kv_question_echo": 32}, "kv_question_echo=32 with "
         "kv_eviction='streamingllm', which judges no query window; valid methods: snapkv, pyramidkv, "),
        ({"kv_eviction": "none", "kv_question_echo": 0}, "kv_question_echo=0 with kv_eviction='none'"),
        ({"kv_eviction": "snapkv", "kv_context": "keep", "kv_question_echo": 8}, "kv_question_echo=8 with "
         "kv_context='keep': a kept context is compressed without its questions"),
    ],
)
def test_bad_overrides_name_the_value_and_the_valid_ones(extra_args, message):
    with pytest.raises(EvictionConfigError) as raised:
        parse_override(extra_args, SERVER)
    assert message in str(raised.value)


def test_critical_methods_run_per_request_only_on_a_server_that_collects_o_proj():
    critical_server = EvictionConfig("critical-ada-snapkv", 128)
    assert parse_override({"kv_eviction": "critical-snapkv"}, critical_server) == RequestOverride(
        "critical-snapkv", 128
    )


def test_kv_prefill_chooses_eviction_between_chunks_for_one_request():
    prompt = 4000
    whole_server = RequestSettings(SERVER, BS, LAYERS)  # the default: one eviction after the last chunk
    assert whole_server.plan_for(prompt).chunk_budget == 0
    chunked = whole_server.resolve({"kv_prefill": "chunked"}).plan_for(prompt)
    # I = 1.5 B' but at least 512 tokens per head, a multiple of the block size away from the prompt's end
    assert chunked.chunk_budget >= 512
    assert chunked.kept_bound == whole_server.plan_for(prompt).kept_bound  # the same final budget
    assert whole_server.resolve({"kv_prefill": "whole"}).plan_for(prompt) == whole_server.plan_for(prompt)

    chunked_config = EvictionConfig("ada-snapkv", 64, {"window": 8}, prefill="chunked", chunk_budget=128)
    chunked_server = RequestSettings(chunked_config, BS, LAYERS)
    assert chunked_server.plan_for(prompt).chunk_budget == 128
    assert chunked_server.resolve({"kv_prefill": "whole"}).plan_for(prompt).chunk_budget == 0
    tenth = chunked_server.resolve({"kv_budget": 0.1, "kv_prefill": "chunked"}).plan_for(prompt)
    assert tenth.chunk_budget == tenth.kept_bound == 416  # I is at least the request's own B'


def test_a_server_with_a_decode_cap_refuses_chunked_prompts():
    from vllm_kvevict.settings.decode_config import DecodeConfig

    capped = EvictionConfig("ada-snapkv", 64, decode=DecodeConfig("roco", 256))
    whole = RequestOverride("ada-snapkv", 64, prefill="whole")
    assert parse_override({"kv_prefill": "whole"}, capped) == whole
    with pytest.raises(EvictionConfigError, match="runs a decode-time cap.*valid here: whole"):
        parse_override({"kv_prefill": "chunked"}, capped)


def test_a_kept_context_needs_whole_block_counts_and_a_server_without_a_decode_cap():
    from vllm_kvevict.settings.decode_config import DecodeConfig

    with pytest.raises(EvictionConfigError) as raised:
        parse_override({"kv_context": "keep", "kv_eviction": "pyramidkv"}, SERVER)
    valid = str(raised.value).split("valid: ")[1].split(", ")
    assert {"snapkv", "knorm", "keydiff", "streamingllm", "expected-attention", "ada-snapkv"} <= set(valid)
    assert not {"pyramidkv", "ada-pyramidkv", "critical-snapkv", "nacl"} & set(valid)
    capped = EvictionConfig("snapkv", 64, decode=DecodeConfig("roco", 256))
    with pytest.raises(EvictionConfigError, match="decode-time cap"):
        parse_override({"kv_context": "keep"}, capped)
    settings = RequestSettings(SERVER, BS, LAYERS)
    keep = settings.resolve({"kv_eviction": "snapkv", "kv_context": "keep"})
    assert keep.keeps_context and keep.identity
    assert settings.resolve({"kv_eviction": "snapkv", "kv_context": "keep", "kv_budget": 0.1}).identity != (
        keep.identity
    )
    assert not settings.resolve({"kv_eviction": "snapkv"}).keeps_context


def test_the_server_method_keeps_its_parameters_and_others_use_their_defaults():
    settings = RequestSettings(SERVER, BS, LAYERS)
    own = settings.resolve({"kv_budget": 0.5})
    other = settings.resolve({"kv_eviction": "snapkv", "kv_budget": 0.5})
    assert own.policy.min_budget == 8 and other.policy.min_budget == 32


def test_invalid_values_fall_back_to_the_server_setting_on_both_sides():
    # An engine driven without the API validator: never crash, and both sides read it the same way.
    assert RequestSettings(SERVER, BS, LAYERS).resolve({"kv_budget": "lots"}) is None


def test_vllm_runs_the_validator_registered_as_a_logits_processor(monkeypatch):
    """The path the API server takes (InputProcessor -> validate_logits_processors_parameters)."""
    monkeypatch.delenv(SERVER_CONFIG_ENV, raising=False)
    publish_server_config(SERVER)
    validate_logits_processors_parameters([VALIDATOR_FQCN], SamplingParams(extra_args={"kv_budget": 0.2}))
    with pytest.raises(VLLMValidationError, match=r"kv_budget=0 is out of range"):
        validate_logits_processors_parameters([VALIDATOR_FQCN], SamplingParams(extra_args={"kv_budget": 0}))


def test_without_eviction_on_the_server_the_keys_are_not_read(monkeypatch):
    monkeypatch.delenv(SERVER_CONFIG_ENV, raising=False)
    validate_logits_processors_parameters([VALIDATOR_FQCN], SamplingParams(extra_args={"kv_budget": 0}))


# ----- the ASGI middleware (streamed requests get their 400 before vLLM answers 200) ---------------------
def call_middleware(body_chunks: list[bytes], content_type: bytes = b"application/json"):
    """(messages the client got, body the app behind the middleware received or None)."""
    seen: dict[str, bytes] = {}

    async def app(scope, receive, send):
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        seen["body"] = body
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    incoming = [{"type": "http.request", "body": chunk, "more_body": i < len(body_chunks) - 1}
                for i, chunk in enumerate(body_chunks)]
    sent: list[dict] = []

    async def receive():
        return incoming.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-type", content_type)]}
    asyncio.run(VllmXargsMiddleware(app)(scope, receive, send))
    return sent, seen.get("body")


def test_middleware_answers_400_for_a_bad_value_before_the_handler(monkeypatch):
    monkeypatch.setenv(SERVER_CONFIG_ENV, json.dumps(SERVER.to_dict()))
    body = json.dumps({"stream": True, "vllm_xargs": {"kv_budget": "lots"}}).encode()
    sent, handled = call_middleware([body[:10], body[10:]])
    assert handled is None
    assert sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == 400 and error["param"] == "vllm_xargs"
    assert "kv_budget='lots' is a string, not a number; valid: an integer >= 1" in error["message"]


@pytest.mark.parametrize(
    "body", [{"vllm_xargs": {"kv_budget": 0.25}}, {"prompt": "no xargs"}, {"vllm_xargs": {"session_id": "s"}}]
)
def test_middleware_passes_valid_requests_with_their_body_intact(monkeypatch, body):
    monkeypatch.setenv(SERVER_CONFIG_ENV, json.dumps(SERVER.to_dict()))
    raw = json.dumps(body).encode()
    sent, handled = call_middleware([raw[:7], raw[7:]])
    assert handled == raw and sent[0]["status"] == 200


def test_middleware_leaves_other_content_and_eviction_off_alone(monkeypatch):
    bad = json.dumps({"vllm_xargs": {"kv_budget": 0}}).encode()
    monkeypatch.setenv(SERVER_CONFIG_ENV, json.dumps(SERVER.to_dict()))
    assert call_middleware([bad], content_type=b"multipart/form-data")[1] == bad
    assert call_middleware([b"{not json vllm_xargs"])[1] == b"{not json vllm_xargs"
    monkeypatch.delenv(SERVER_CONFIG_ENV)
    assert call_middleware([bad])[1] == bad


# ----- scheduler and worker agree -------------------------------------------------------------------------
def scheduler_manager() -> KVCacheManager:
    """vLLM's real KVCacheManager over one evicting group, with the allocate_slots wrapper installed."""
    register_evicting_spec()
    vllm_patches.install_eviction_hooks()
    spec = EvictingAttentionSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=DIM, dtype=torch.bfloat16,
        eviction=SERVER, num_model_layers=LAYERS,
    )
    group = KVCacheGroupSpec(["l"], spec)
    config = KVCacheConfig(num_blocks=200, kv_cache_tensors=[], kv_cache_groups=[group])
    return KVCacheManager(config, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS,
                          enable_caching=False)


REQUESTS = {  # request id -> (prompt length, extra_args)
    "server-default": (400, None),
    "fraction": (500, {"kv_budget": 0.1}),
    "other-method": (450, {"kv_eviction": "snapkv", "kv_budget": 100}),
    "kept-whole": (420, {"kv_eviction": "none"}),
}


def test_scheduler_and_worker_agree_on_each_requests_plan():
    torch.manual_seed(0)
    manager = scheduler_manager()
    free_at_start = manager.block_pool.get_num_free_blocks()
    requests = {
        rid: Request(rid, list(range(prompt)), SamplingParams(max_tokens=4, extra_args=xargs), None)
        for rid, (prompt, xargs) in REQUESTS.items()
    }
    rows = {rid: manager.allocate_slots(req, req.num_prompt_tokens).get_block_ids()[0]
            for rid, req in requests.items()}

    # Worker: the prefill step of all four, each with its own extra_args, as the runner hook passes them.
    worker = EvictionWorker(SERVER.build_policy(), SERVER, LAYERS, HEADS, BS)
    ids = list(REQUESTS)
    prompts = [REQUESTS[rid][0] for rid in ids]
    worker.begin_step(StepInputs(ids, np.array(prompts), np.zeros(4, dtype=np.int64), np.array(prompts),
                                 extra_args=[REQUESTS[rid][1] for rid in ids]))
    width = max(len(r) for r in rows.values())
    table = torch.zeros(4, width, dtype=torch.int32)
    for i, rid in enumerate(ids):
        table[i, : len(rows[rid])] = torch.tensor(rows[rid])
    slots = torch.cat([torch.tensor(rows[rid])[torch.arange(p) // BS] * BS + torch.arange(p) % BS
                       for rid, p in zip(ids, prompts, strict=True)])
    step = worker.make_step(4, sum(prompts), torch.tensor(prompts), table, slots)
    tokens = sum(prompts)
    writes = [step.compact_layer(layer, torch.randn(tokens, HEADS * GROUP, DIM),
                                 torch.randn(tokens, HEADS, DIM), torch.randn(tokens, HEADS, DIM))
              for layer in range(LAYERS)]

    # Scheduler: the prompts are processed; the manager frees each request's leading blocks.
    for req in requests.values():
        req.num_computed_tokens = req.num_prompt_tokens
        manager.allocate_slots(req, 1)
    evicting = manager.coordinator.single_type_managers[0]
    held = {rid: {b.block_id for b in evicting.req_to_blocks[rid] if not b.is_null} for rid in ids}

    compacting = {req.req_id: req for req in step.compacting}
    assert set(compacting) == {"server-default", "fraction", "other-method"}
    for rid in ids:
        plan = evicting.request_plan(rid, REQUESTS[rid][0])
        assert len(rows[rid]) - len(held[rid]) == plan.blocks_to_free
        if rid == "kept-whole":
            assert not plan.compacts and plan.blocks_to_free == 0
            continue
        assert compacting[rid].plan == plan
        assert worker.kept_tokens[rid] == pytest.approx(sum(plan.layer_budgets) / LAYERS)
    assert compacting["fraction"].plan.layer_budgets[0] == 52  # 10% of 500 = 50, aligned to 500 - 14 * 32
    assert compacting["other-method"].policy.name == "snapkv"

    # Every kept entry the worker wrote lies in a block the scheduler still holds for that request.
    starts = np.cumsum([0, *prompts])
    for write in writes:
        owner = np.searchsorted(starts, write.tokens.numpy(), side="right") - 1
        blocks = (write.slots // BS // HEADS).numpy()
        for index, rid in enumerate(ids):
            assert set(blocks[owner == index].tolist()) <= held[rid]

    for req in requests.values():
        manager.free(req)
    assert manager.block_pool.get_num_free_blocks() == free_at_start


def test_a_trailing_window_sets_the_plan_of_every_request_that_evicts_per_chunk():
    """The server's ``trailing_window`` reaches the plans of the server's setting and of a request's own
    budget alike (both sides build them from the same values); a whole-prompt request has none."""
    config = EvictionConfig("ada-snapkv", 0.1, prefill="chunked", trailing_window=256)
    settings = RequestSettings(config, 32, 30)
    plan = settings.plan_for(4096)
    assert (plan.trailing_window, plan.kept_bound) == (256, 416)
    assert plan.trailing_floor == 36  # blend's minimum: the method's window of 32 and 4 sinks
    assert plan.kept_length_at(512) == 64  # FastKVzip's ratio raised to the floor, block-aligned
    quarter = settings.resolve({"kv_budget": 0.25}).plan_for(4096)
    assert quarter.trailing_window == 256 and quarter.kept_length_at(512) < 512
    assert settings.resolve({"kv_prefill": "whole"}).plan_for(4096).trailing_window == 0


def test_a_pooled_server_takes_a_budget_a_prefill_mode_a_kept_context_or_none_per_request():
    pooled = EvictionConfig("kvzap", 0.25, {"budget_scope": "model"})
    assert parse_override({"kv_budget": 0.1}, pooled) == RequestOverride("kvzap", 0.1)
    chunked = parse_override({"kv_prefill": "chunked"}, pooled)
    assert chunked is not None and chunked.prefill == "chunked"
    assert parse_override({"kv_eviction": "none"}, pooled) == RequestOverride("none", None)
    with pytest.raises(EvictionConfigError, match=r"'snapkv' on a server with .*valid: kvzap, none"):
        parse_override({"kv_eviction": "snapkv"}, pooled)
    kept = parse_override({"kv_context": "keep"}, pooled)
    assert kept is not None and kept.context
    with pytest.raises(EvictionConfigError, match=r"kv_question_echo=8 is not served.*valid keys"):
        parse_override({"kv_question_echo": 8}, pooled)


def test_a_pooled_server_with_a_decode_cap_takes_a_requests_own_cap_and_no_kept_context():
    raw = {"method": "kvzap", "budget": 0.25, "params": {"budget_scope": "model"}}
    capped = EvictionConfig.from_dict({**raw, "decode": {"method": "kvzap", "budget": 256}})
    own = parse_override({"kv_decode_budget": 128}, capped)
    assert own is not None and own.decode_budget == 128
    with pytest.raises(EvictionConfigError, match=r"kv_context='keep': this server runs a decode-time cap"):
        parse_override({"kv_context": "keep"}, capped)
    with pytest.raises(EvictionConfigError, match=r"kv_decode_budget=128: this server runs no decode-time"):
        parse_override({"kv_decode_budget": 128}, EvictionConfig.from_dict(raw))


def test_a_pooled_threshold_server_keeps_no_context_and_evicts_between_chunks_where_per_layer_does_not():
    pooled = EvictionConfig("kvzap", 0.5, {"budget_scope": "model", "threshold": -3.5})
    assert parse_override({"kv_budget": 0.25}, pooled) == RequestOverride("kvzap", 0.25)
    with pytest.raises(EvictionConfigError, match=r"'keep'.*valid: none on this server .*threshold"):
        parse_override({"kv_context": "keep"}, pooled)
    chunked = parse_override({"kv_prefill": "chunked"}, pooled)
    assert chunked is not None and chunked.prefill == "chunked"
    per_layer = EvictionConfig("kvzap", 0.5, {"threshold": -3.5})
    with pytest.raises(EvictionConfigError, match=r"prefill=chunked and threshold=-3.5.*budget_scope: model"):
        parse_override({"kv_prefill": "chunked"}, per_layer)
