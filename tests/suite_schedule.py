"""The order and grouping in which xdist deals out the suite (``tests/conftest.py`` applies them)."""

from __future__ import annotations

#: Modules that start servers, slowest first (setup + calls, seconds on one core of the 2-core AVX2 machine in
#: the xdist run of 2026-11-26). xdist deals these out first, so the two workers end together on the short
#: unit tests; a stale entry only changes the order.
SLOWEST_FIRST = (
    "tests/e2e/test_eviction_server.py",  # ~700: three servers (vanilla, eviction, TP=3)
    "tests/reliability",  # ~650: one scope, see ONE_SCOPE
    "tests/reliability/test_chunked_sampling.py",  # ~150 (2026-11-27): its own plain and evicting servers
    "tests/e2e/test_serve_eviction_flags.py",  # ~330: the compiled server's torch.compile warm-up
    "tests/e2e/test_chunked_prefill_reference.py",  # ~260: two servers + HF reference
    "tests/e2e/test_decode_eviction_server.py",  # ~310: 2,000 capped tokens + HF reference
    "tests/e2e/test_compacted_attention_reference.py",  # ~190
    "tests/e2e/test_pooled_blocks_server.py",  # ~100 alone (2026-12-06, AMX): server, three HF references
    "tests/e2e/test_threshold_server.py",  # ~95 (2026-12-06, AMX): two servers (per layer, pooled)
    "tests/e2e/test_dashboard_prometheus.py",  # ~170: server + Prometheus
    "tests/unit/evaluation/test_kvpress_script.py",  # ~95: kvpress in .venv-ref
    "tests/install/test_wheel_install.py",  # ~70 (alone, 2026-11-27): wheel build, fresh venv, two servers
    "tests/e2e/test_prefix_caching_server.py",
    "tests/e2e/test_serve_command.py",
    "tests/e2e/test_eval_cli.py",
    "tests/e2e/test_examples.py",  # one server, four example scripts
    "tests/e2e/test_criticalkv_server.py",
    "tests/e2e/test_model_matrix.py",  # ~35: two tiny models
    "tests/gpu_bundle/test_gpu_bundle.py",  # ~35: builds the GPU bundle once
)
#: Directories scheduled as one xdist scope: the reliability files share one session-scoped server
#: (tests/reliability/conftest.py), which each worker running any of them would otherwise start again.
ONE_SCOPE = ("tests/reliability",)
#: Modules inside a ONE_SCOPE directory that start servers of their own: a scope of their own, so the other
#: worker can run them.
OWN_SCOPE = ("tests/reliability/test_chunked_sampling.py",)


def scope_of(nodeid: str) -> str:
    """The xdist scope of a test id: its module, or the ``ONE_SCOPE`` directory that holds it."""
    module = nodeid.split("::", 1)[0]
    if module in OWN_SCOPE:
        return module
    return next((d for d in ONE_SCOPE if module.startswith(d + "/")), module)


def schedule_rank(nodeid: str) -> int:
    """Position of a test's scope in ``SLOWEST_FIRST`` (unlisted scopes after every listed one)."""
    scope = scope_of(nodeid)
    return SLOWEST_FIRST.index(scope) if scope in SLOWEST_FIRST else len(SLOWEST_FIRST)
