"""The listing of every part of vLLM the plugin relies on (``vllm_adapter/vllm_boundary/``) holds against
the installed vLLM, and nothing of vLLM is used that it does not list.

The first tests fail when vLLM moves or changes a listed part (a module, a name, a method's parameters, an
attribute); the scans fail when a module of ``vllm_kvevict`` imports, wraps or overrides a part of vLLM the
listing lacks. The checkers' own tests plant such a change and see it reported.
"""

from __future__ import annotations

import ast
import dataclasses

import pytest
import vllm_sources as sources

from vllm_kvevict.vllm_adapter import vllm_boundary as boundary

METHODS = boundary.WRAPPED + boundary.OVERRIDDEN + boundary.CALLED


def test_the_listing_was_checked_on_the_installed_vllm() -> None:
    from vllm.version import __version__

    assert __version__.split("+")[0] == boundary.CHECKED_VLLM_VERSION


@pytest.mark.parametrize("entry", boundary.IMPORTS, ids=lambda e: f"{e.owner}:{e.names}")
def test_every_listed_import_resolves(entry: boundary.VllmPart) -> None:
    assert sources.import_problem(entry) is None


@pytest.mark.parametrize("entry", METHODS, ids=lambda e: f"{e.use}:{e.owner.rpartition('.')[2]}.{e.names}")
def test_every_listed_method_keeps_its_parameters(entry: boundary.VllmPart) -> None:
    assert sources.method_problem(entry) is None


@pytest.mark.parametrize("entry", boundary.READ, ids=lambda e: e.owner.rpartition(".")[2])
def test_every_listed_attribute_is_still_defined(entry: boundary.VllmPart) -> None:
    assert sources.attributes_problem(entry) is None


def test_every_entry_says_why_and_how_it_is_used() -> None:
    entries = (*boundary.IMPORTS, *METHODS, *boundary.READ)
    assert all(entry.why for entry in entries)
    assert {m.use for m in boundary.WRAPPED} == {"wraps"}
    assert {m.use for m in boundary.OVERRIDDEN} == {"overrides"}
    assert {m.use for m in boundary.CALLED} == {"calls"}
    assert {e.use for e in boundary.IMPORTS} == {"imports"}
    assert {e.use for e in boundary.READ} == {"reads"}


def test_an_entry_of_no_known_use_is_refused() -> None:
    with pytest.raises(ValueError, match="use='patches' is not valid; valid: imports, wraps"):
        boundary.VllmPart("patches", "vllm.v1.core.sched.scheduler.Scheduler", "schedule", "planted")


def test_no_module_imports_an_unlisted_part_of_vllm() -> None:
    unlisted = {
        name: found
        for name, path in sources.plugin_modules()
        if (found := sources.unlisted_imports(sources.parsed(str(path)), boundary.IMPORTS))
    }
    assert unlisted == {}


def test_every_wrapper_of_vllm_patches_is_listed() -> None:
    tree = sources.parsed(str(sources.PACKAGE / "vllm_adapter" / "vllm_patches.py"))
    listed = {(m.owner.rpartition(".")[2], m.names) for m in boundary.WRAPPED}
    assert sources.wrapped_in(tree) - listed == set()


def test_every_override_of_a_vllm_method_is_listed() -> None:
    subclassing = [name for name, path in sources.plugin_modules() if sources.imports_vllm(path)]
    listed = {(sources.resolve(m.owner), m.names) for m in boundary.OVERRIDDEN}
    unlisted = set()
    for module_name in subclassing:
        for base, name in sources.overridden_by(module_name):
            if not any(owner in base.__mro__ or base in owner.__mro__ for owner, n in listed if n == name):
                unlisted.add(f"{module_name}: {base.__module__}.{base.__name__}.{name}")
    assert unlisted == set()


# ----- the checkers see a planted change -------------------------------------------------------------------
def test_a_changed_signature_is_reported() -> None:
    entry = boundary.WRAPPED[0]
    planted = dataclasses.replace(entry, params=entry.params + " extra")
    assert "parameters" in str(sources.method_problem(planted))


def test_a_method_vllm_no_longer_has_is_reported() -> None:
    planted = dataclasses.replace(boundary.CALLED[0], names="_insert_block_hash_renamed")
    assert "no such method" in str(sources.method_problem(planted))


def test_a_missing_attribute_is_reported() -> None:
    planted = dataclasses.replace(boundary.READ[0], names="input_batch _model_runner_output_renamed")
    assert sources.attributes_problem(planted) == f"{planted.owner}: no _model_runner_output_renamed"


def test_a_moved_module_or_name_is_reported() -> None:
    moved = boundary.imported("vllm.v1.core.kv_cache_utils_moved", "resolve_block_hashes", "planted")
    renamed = boundary.imported("vllm.v1.core.kv_cache_utils", "resolve_block_hashes_renamed", "planted")
    assert sources.import_problem(moved) is not None
    assert "not found" in str(sources.import_problem(renamed))


def test_an_unlisted_private_import_is_reported() -> None:
    tree = ast.parse("from vllm.v1.core.block_pool import BlockPool\nimport vllm.v1.worker.block_table\n")
    assert sources.unlisted_imports(tree, boundary.IMPORTS) == [
        "line 1: vllm.v1.core.block_pool.BlockPool",
        "line 2: vllm.v1.worker.block_table",
    ]


def test_an_unlisted_wrapper_is_reported() -> None:
    source = "from vllm.v1.core.sched.scheduler import Scheduler\n_wrap(Scheduler, 'schedule', body)\n"
    tree = ast.parse(source)
    assert sources.wrapped_in(tree) == {("Scheduler", "schedule")}
