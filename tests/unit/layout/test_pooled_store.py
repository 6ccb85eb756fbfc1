"""The pooled mode of ``SubBlockStore`` (``layer_blocks`` > 0: one pool of global sub-block ids shared by a
request's layers, ``docs/design_modes.md``, "Per-layer block budgets") against the plain model
``PooledRequestSubBlocks``.

vLLM is simulated as in ``test_batch_tables.py`` (blocks handed out per position, requests coming, going and
changing slots, compacted and standard rows in one batch), with the pooled accounting: B' is the MEAN kept
count over all layers and heads, aligned so that P - B' is a multiple of bs; the scheduler frees s = (P -
B')/bs - 1 leading blocks, so the request holds ceil((B' + t)/bs) + 1 blocks after t more tokens, and one
layer may keep many more entries than another.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from layout_cases import block_table_of, ragged_counts

from tests.unit.layout.subblock_reference import PooledRequestSubBlocks, SubBlockPoolExhausted
from vllm_kvevict.layout.accounting import align_budget, cdiv
from vllm_kvevict.layout.batch_tables import BatchSubBlocks
from vllm_kvevict.layout.subblock_store import SubBlockStore

LAYERS = 4
NB = 1024  # blocks of one layer's cache: layer l's sub-blocks are [l*NB*H, (l+1)*NB*H)


def pooled_counts(rng: random.Random, layers: int, heads: int, total: int, cap: int) -> list[list[int]]:
    """[L][H] kept counts summing to ``total``, ragged across layers and heads alike."""
    flat = ragged_counts(total, layers * heads, cap, rng)
    return [flat[layer * heads : (layer + 1) * heads] for layer in range(layers)]


class PooledSimulation:
    """Requests, their vLLM block rows, the pooled reference and a pooled ``BatchSubBlocks`` side by side."""

    def __init__(self, rng: random.Random, heads: int, block_size: int, check: bool) -> None:
        self.rng, self.heads, self.bs, self.check = rng, heads, block_size, check
        self.tables = BatchSubBlocks(LAYERS, heads, block_size, shared=False, capacity=2, layer_blocks=NB)
        self.next_block = itertools.count(1)  # 0 is vLLM's null block
        self.rows: dict[str, list[int]] = {}
        self.lengths: dict[str, int] = {}
        self.reference: dict[str, PooledRequestSubBlocks] = {}
        self.width = 64

    def block_table(self, req_ids: list[str]) -> torch.Tensor:
        return block_table_of(self.rows, req_ids, self.width)

    def prefill(self, req_ids: list[str], prompts: list[int], budget: int, trailing: int = 0) -> None:
        """One step computing every prompt (and ``trailing`` tokens after it); a request whose prompt frees
        a block is compacted layer by layer, each layer's pool entries following the previous layer's."""
        bs, heads = self.bs, self.heads
        for req_id, prompt in zip(req_ids, prompts, strict=True):
            self.rows[req_id] = [next(self.next_block) for _ in range(cdiv(prompt + trailing, bs))]
            self.lengths[req_id] = prompt + trailing
        table = self.block_table(req_ids)
        store = self.tables.begin(req_ids, np.zeros(len(req_ids), dtype=np.int64), table)
        self.tables.skip(len(req_ids))
        for slot, (req_id, prompt) in enumerate(zip(req_ids, prompts, strict=True)):
            kept = align_budget(prompt, budget, bs)
            freed = (prompt - kept) // bs - 1
            if freed < 1:
                continue  # within budget: standard layout
            total = max(0, LAYERS * heads * kept - self.rng.randint(0, heads * bs))
            counts = pooled_counts(self.rng, LAYERS, heads, total, prompt)
            reference = PooledRequestSubBlocks(LAYERS, heads, bs, NB, freed, self.rows[req_id][freed:])
            # The pool's start as a host int or as a device tensor (no read): both must work.
            pool_start: int | torch.Tensor = torch.tensor(0) if slot % 2 else 0
            for layer, layer_counts in enumerate(counts):
                reference.compact_layer(layer, layer_counts, trailing)
                pending = store.assign(
                    torch.tensor(layer_counts),
                    table[slot],
                    freed,
                    trailing,
                    sum(layer_counts),
                    cdiv(prompt + trailing, bs),
                    self.check,
                    pool_start=pool_start,
                )
                pool_start = pool_start + (pending.cursor if slot % 2 else int(pending.cursor))
                # The shared cursor given, or derived from the table (pending.pool_start + cursor).
                self.tables.commit(layer, slot, pending, freed, pool_cursor=pool_start if slot % 2 else None)
            taken = LAYERS * heads * len(reference.blocks) - reference.num_free
            assert int(store.pool_cursor[slot]) == int(pool_start) == taken
            self.tables.mark_compacted(slot)
            self.rows[req_id][:freed] = [0] * freed  # freed by the scheduler
            self.reference[req_id] = reference

    def decode(self, req_ids: list[str], q_lens: list[int]) -> None:
        """One step: each request computes q tokens; the store must equal the reference."""
        bs, heads = self.bs, self.heads
        computed = np.array([self.lengths[r] for r in req_ids], dtype=np.int64)
        for req_id, q in zip(req_ids, q_lens, strict=True):
            self.lengths[req_id] += q
            while len(self.rows[req_id]) < cdiv(self.lengths[req_id], bs):
                self.rows[req_id].append(next(self.next_block))
        assert max(max(row) for row in self.rows.values()) < NB
        table = self.block_table(req_ids)
        store = self.tables.begin(req_ids, computed, table)
        layout = self.tables.layout(computed, np.array(q_lens, dtype=np.int64), table, self.check)
        t0 = 0
        for slot, (req_id, q) in enumerate(zip(req_ids, q_lens, strict=True)):
            reference = self.reference.get(req_id)
            if reference is not None:
                reference.sync_blocks(self.rows[req_id], cdiv(self.lengths[req_id], bs))
                reference.append(q)
                taken = LAYERS * heads * len(reference.blocks) - reference.num_free
                assert int(store.pool_cursor[slot]) == int(store.cursor[:, slot].sum()) == taken
            for layer in range(LAYERS):
                lengths = store.lengths[layer, slot].tolist()
                rows = store.tables[layer, slot].tolist()
                slots = layout.token_slots[layer, t0 : t0 + q]
                if reference is None:  # standard layout in the layer's own region
                    assert lengths == [self.lengths[req_id]] * heads
                    n = cdiv(self.lengths[req_id], bs)
                    blocks = torch.tensor(self.rows[req_id])
                    for h in range(heads):
                        assert rows[h][:n] == [(layer * NB + b) * heads + h for b in blocks[:n].tolist()]
                    positions = torch.arange(self.lengths[req_id] - q, self.lengths[req_id])
                    ids = (layer * NB + blocks[positions // bs])[:, None] * heads + torch.arange(heads)
                    assert torch.equal(slots, ids * bs + (positions % bs)[:, None])
                    continue
                ref_table = reference.layer_tables[layer]
                assert lengths == ref_table.lengths
                for h in range(heads):
                    assert rows[h][: len(ref_table.subblocks[h])] == ref_table.subblocks[h]
                ref_slots = torch.stack([ref_table.head_slots(h)[-q:] for h in range(heads)], dim=1)
                assert torch.equal(slots, ref_slots)
            t0 += q
        for reference in self.reference.values():  # no sub-block twice, none lost, none foreign
            owned = reference.owned_subblocks()
            assert sorted(owned) == sorted(
                reference.subblock(layer, b, h)
                for b in reference.blocks
                for layer in range(LAYERS)
                for h in range(heads)
            )


def state(store: SubBlockStore, num_slots: int) -> dict[str, torch.Tensor]:
    return {
        "tables": store.tables[:, :num_slots],
        "lengths": store.lengths[:, :num_slots],
        "tail": store.tail[:, :num_slots],
        "cursor": store.cursor[:, :num_slots],
        "pool_cursor": store.pool_cursor[:num_slots],
        "first_block": store.first_block[:num_slots],
    }


def compact_layers(
    store: SubBlockStore, counts: list[list[int]], row: torch.Tensor, first_block: int, num_blocks: int
) -> None:
    """Compact slot 0's layers in layer order with ``counts`` [L][H] kept entries, each layer's table taken
    from the pool entries after the earlier layers' (what ``pooled_eviction`` does)."""
    pool_start = 0
    for layer, layer_counts in enumerate(counts):
        table = store.assign(
            torch.tensor(layer_counts), row, first_block, 0, sum(layer_counts), num_blocks, True,
            pool_start=pool_start,
        )
        pool_start += int(table.cursor)
        store.commit(layer, 0, table, first_block)


@pytest.mark.parametrize("seed", range(12))
def test_pooled_store_matches_the_pooled_reference_with_sparse_and_dense_growth_alike(seed: int) -> None:
    """The CPU (sparse) and GPU-style (dense) growth both equal the reference and leave identical stores."""
    rng = random.Random(seed)
    heads = rng.choice([1, 2, 3, 4])
    block_size = [16, 32, 48][seed % 3]  # 48: a block size that is not a power of two
    sims = [PooledSimulation(random.Random(seed + 100), heads, block_size, check) for check in (True, False)]

    def step(method: str, *args) -> None:  # noqa: ANN002
        for sim in sims:
            getattr(sim, method)(*args)
        stores = [sim.tables.store for sim in sims]
        num_slots = len(args[0])
        for name, value in state(stores[0], num_slots).items():
            assert torch.equal(value, state(stores[1], num_slots)[name]), name

    req_ids = [f"r{i}" for i in range(rng.randint(2, 5))]
    prompts = [rng.randint(4 * block_size, 10 * block_size) for _ in req_ids]
    prompts[-1] = block_size // 2  # one request stays in the standard layout
    trailing = rng.choice([0, 0, 3, block_size + 1])
    step("prefill", req_ids, prompts, rng.randint(1, 2 * block_size), trailing)
    for i in range(rng.randint(2 * block_size, 3 * block_size)):
        if i == block_size:  # a new request arrives (alone in its prefill step: the others move out)
            step("prefill", ["late"], [rng.randint(5 * block_size, 8 * block_size)], block_size)
            req_ids = [*req_ids, "late"]
        if i == block_size + 5 and len(req_ids) > 2:  # a request finishes
            gone = req_ids.pop(0)
            for sim in sims:
                sim.tables.forget(gone)
        batch = rng.sample(req_ids, rng.randint(1, len(req_ids)))
        q_lens = [1 if rng.random() < 0.85 else rng.randint(2, block_size + 3) for _ in batch]
        step("decode", batch, q_lens)


def test_pool_entries_run_block_then_layer_then_head() -> None:
    """Entry k: layer (k // H) % L, block row[first + k // (L*H)], head slot k % H (hand-computed)."""
    layers, heads, bs, nb = 2, 2, 4, 10
    store = SubBlockStore(layers, heads, bs, width=4, capacity=1, device="cpu", layer_blocks=nb)
    row = torch.tensor([0, 3, 5, 0], dtype=torch.int32)  # block 0 of the row was freed: first = 1
    # Layer 0 keeps 5 tokens on head 0 (two sub-blocks), none on head 1; layer 1 keeps 4 and 3.
    t0 = store.assign(torch.tensor([5, 0]), row, 1, 0, 5, 3, True, pool_start=0)
    t1 = store.assign(torch.tensor([4, 3]), row, 1, 0, 7, 3, True, pool_start=int(t0.cursor))
    # Block 3's entries: (layer 0, heads 0-1) = ids 6, 7, then (layer 1, heads 0-1) = ids 26, 27.
    assert t0.rows[0, :2].tolist() == [6, 7] and int(t0.cursor) == 2
    assert t1.rows[:, 0].tolist() == [26, 27] and int(t1.cursor) == 2
    store.commit(0, 0, t0, 1)
    store.commit(1, 0, t1, 1, pool_cursor=4)
    assert store.pool_cursor.tolist() == [4] and store.cursor[:, 0].tolist() == [2, 2]
    # One token: layer 0 head 1 (empty) and layer 1 head 0 (full) need a sub-block, in layer order: entries
    # 4 and 5 are heads 0 and 1 of layer 0 of block 5 (ids 10, 11), whichever layer takes them.
    grown = torch.tensor([True])
    store.grow(1, torch.tensor([1]), grown, grown, row[None], torch.tensor([3]), 1, True, single_token=True)
    assert store.tables[0, 0, 1, 0] == 10 and store.tables[1, 0, 0, :2].tolist() == [26, 11]
    assert store.tail[:, 0].tolist() == [[7, 10], [11, 27]]
    assert store.pool_cursor.tolist() == [6] and store.cursor[:, 0].tolist() == [3, 3]
    reference = PooledRequestSubBlocks(layers, heads, bs, nb, 1, [3, 5])
    reference.compact_layer(0, [5, 0])
    reference.compact_layer(1, [4, 3])
    reference.append(1)
    assert [table.subblocks for table in reference.tables] == [[[6, 7], [10]], [[26, 11], [27]]]


@pytest.mark.parametrize("check", [True, False])
def test_standard_rows_read_their_own_layers_region(check: bool) -> None:
    """Standard rows, rebuilt or grown, hold head h of block b of layer g: id (g*NB + b)*H + h."""
    layers, heads, bs, nb = 3, 2, 16, 40
    store = SubBlockStore(layers, heads, bs, width=8, capacity=2, device="cpu", layer_blocks=nb)
    rows = torch.tensor([[7, 8, 9, 0, 0, 0, 0, 0], [30, 31, 32, 33, 34, 35, 36, 37]], dtype=torch.int32)
    store.refresh_standard(torch.tensor([0, 1]), rows, torch.tensor([2 * bs, 3 * bs - 1]))
    no = torch.tensor([False, False])
    # Slot 0 grows one token into a new block, slot 1 grows 3 * bs + 2 tokens (four new sub-blocks).
    q_lens = torch.tensor([1, 3 * bs + 2])
    store.grow(2, q_lens, torch.tensor([True, True]), no, rows, torch.tensor([3, 7]), 4, check)
    for layer in range(layers):
        for slot, n in ((0, 3), (1, 7)):
            ids = store.tables[layer, slot, :, :n]
            blocks = layer * nb + rows[slot, :n].to(torch.int64)
            want = blocks[None, :] * heads + torch.arange(heads)[:, None]
            assert torch.equal(ids.to(torch.int64), want)
            assert bool((ids // (nb * heads) == layer).all())  # in the layer's region
            assert torch.equal(store.tail[layer, slot], ids[:, -1])
    slots = store.token_slots(None, None, torch.tensor([1, 1]), 2)  # last token of each row
    assert slots[2, 0].tolist() == [((2 * nb + 9) * heads + h) * bs for h in range(heads)]


@pytest.mark.parametrize("check", [True, False])
def test_a_shared_prefix_is_read_in_each_layers_region_before_the_pooled_entries(check: bool) -> None:
    """With ``shared_blocks`` = c every layer's table first reads the c leading blocks of the row in that
    layer's own region (the standard rows of a prefix shared through vLLM's prefix cache), then the same
    pool entries as without a prefix; its lengths count the prefix, and growth takes the next pool entry."""
    layers, heads, bs, nb, c = 3, 2, 16, 40, 2
    row = torch.tensor([5, 9, 11, 12, 13, 14, 0, 0], dtype=torch.int32)
    counts = [[7, 20], [3, 0], [16, 9]]
    tables = {}
    for shared in (0, c):
        store = SubBlockStore(layers, heads, bs, width=8, capacity=1, device="cpu", layer_blocks=nb)
        taken, tables[shared] = 0, []
        for layer, layer_counts in enumerate(counts):
            table = store.assign(
                torch.tensor(layer_counts), row, 4, 0, sum(layer_counts), 6, True, shared,
                pool_start=taken, group=layer,
            )  # fmt: skip
            taken += int(table.cursor)
            store.commit(layer, 0, table, 4, pool_cursor=taken)
            tables[shared].append(table)
        if shared:
            yes = torch.tensor([True])
            store.grow(1, torch.tensor([1]), yes, yes, row[None], torch.tensor([6]), 1, check)
            grown = store.tables[1, 0, 1, c]  # layer 1 head 1 held nothing: its first own sub-block
            column, offset = store._pool_entry(taken)
            assert int(grown) == int(row[4 + column]) * heads + offset
    for layer, (alone, after) in enumerate(zip(tables[0], tables[c], strict=True)):
        prefix = (layer * nb + row[:c].to(torch.int64))[None, :] * heads + torch.arange(heads)[:, None]
        assert torch.equal(after.rows[:, :c].to(torch.int64), prefix)
        assert torch.equal(after.rows[:, c:], alone.rows[:, : 8 - c])
        assert after.lengths.tolist() == [n + c * bs for n in counts[layer]]
        assert int(after.cursor) == int(alone.cursor)


def demand(counts: list[list[int]], tokens: int, bs: int) -> int:
    """Sub-blocks the (layer, head) pairs need after ``tokens`` more tokens: Σ_lh ceil((B_lh + t)/bs)."""
    return sum(cdiv(c + tokens, bs) for layer in counts for c in layer)


@pytest.mark.parametrize("seed", range(16))
def test_a_request_within_the_mean_rule_fits_and_one_past_it_runs_dry(seed: int) -> None:
    """With Σ B_lh <= L*H*B' (B' the mean over layers and heads, aligned) the request fits in ceil((B' +
    t)/bs) + 1 blocks after t tokens; past it, the store and the reference run dry at the first t (0: at
    compaction) where the (layer, head) pairs need more sub-blocks than L*H times the blocks held."""
    rng = random.Random(seed)
    bs = [16, 32, 48][seed % 3]
    layers, heads = rng.choice([1, 2, 3, 5]), rng.choice([1, 2, 3, 4])
    prompt = rng.randint(6 * bs, 12 * bs)
    kept = align_budget(prompt, rng.randint(1, 2 * bs), bs)
    freed = (prompt - kept) // bs - 1
    within = seed % 2 == 0
    spread = layers * heads * bs
    total = layers * heads * kept + (-rng.randint(0, spread) if within else rng.randint(1, 2 * spread))
    counts = pooled_counts(rng, layers, heads, max(total, 0), prompt)
    steps = 3 * bs
    supply = [layers * heads * (cdiv(kept + t, bs) + 1) for t in range(steps + 1)]  # sub-blocks held
    over = [t for t in range(steps + 1) if demand(counts, t, bs) > supply[t]]
    if within:
        assert not over  # the accounting rule, B' the mean
    expected = over[0] if over else None
    row = torch.arange(1, cdiv(prompt + steps, bs) + 1, dtype=torch.int32)
    row[:freed] = 0

    def store_runs_dry_at() -> int | None:
        store = SubBlockStore(layers, heads, bs, len(row), capacity=1, device="cpu", layer_blocks=NB)
        try:
            compact_layers(store, counts, row, freed, cdiv(prompt, bs))
        except SubBlockPoolExhausted:
            return 0
        one, yes = torch.tensor([1]), torch.tensor([True])
        for t in range(1, steps + 1):
            num_blocks = torch.tensor([cdiv(prompt + t, bs)])
            try:
                store.grow(1, one, yes, yes, row[None], num_blocks, 1, True, single_token=True)
            except SubBlockPoolExhausted:
                return t
            assert int(store.pool_cursor[0]) == demand(counts, t, bs)
        return None

    def reference_runs_dry_at() -> int | None:
        kept_row = row[freed : cdiv(prompt, bs)].tolist()
        reference = PooledRequestSubBlocks(layers, heads, bs, NB, freed, kept_row)
        try:
            for layer, layer_counts in enumerate(counts):
                reference.compact_layer(layer, layer_counts)
        except SubBlockPoolExhausted:
            return 0
        for t in range(1, steps + 1):
            reference.sync_blocks(row.tolist(), cdiv(prompt + t, bs))
            try:
                reference.append(1)
            except SubBlockPoolExhausted:
                return t
        return None

    assert store_runs_dry_at() == reference_runs_dry_at() == expected


def test_a_layer_may_hold_more_than_its_share_of_the_request_blocks() -> None:
    """Two layers, two heads, B' = 16 (2 blocks held): layer 0 keeps 33 + 31 tokens (5 sub-blocks, more than
    the 4 a per-layer pool of those blocks has), layer 1 none. The pooled request fits and grows with the
    rule; when its row stops growing it runs dry at the first step its pairs need more than it holds."""
    layers, heads, bs = 2, 2, 16
    prompt = 16 + 8 * bs
    kept = align_budget(prompt, 16, bs)
    freed = (prompt - kept) // bs - 1
    assert (kept, freed) == (16, 7)
    counts = [[33, 31], [0, 0]]
    row = torch.arange(1, 20, dtype=torch.int32)
    row[:freed] = 0
    per_layer = SubBlockStore(layers, heads, bs, len(row), capacity=1, device="cpu")
    with pytest.raises(SubBlockPoolExhausted, match="accounting rule"):
        per_layer.assign(torch.tensor(counts[0]), row, freed, 0, 64, cdiv(prompt, bs), True)
    store = SubBlockStore(layers, heads, bs, len(row), capacity=1, device="cpu", layer_blocks=NB)
    compact_layers(store, counts, row, freed, cdiv(prompt, bs))
    assert store.pool_cursor.tolist() == [5] and store.cursor[:, 0].tolist() == [5, 0]
    one, yes = torch.tensor([1]), torch.tensor([True])
    for t in range(1, bs + 1):  # the rule: the row grows with the sequence
        store.grow(1, one, yes, yes, row[None], torch.tensor([cdiv(prompt + t, bs)]), 1, True)
        assert int(store.pool_cursor[0]) == demand(counts, t, bs)
    frozen = torch.tensor([cdiv(prompt + bs, bs)])  # then no new block (a scheduler breaking the rule)
    supply = layers * heads * (int(frozen) - freed)
    dry = next(t for t in itertools.count(bs + 1) if demand(counts, t, bs) > supply)
    for _ in range(bs + 1, dry):
        store.grow(1, one, yes, yes, row[None], frozen, 1, True)
    with pytest.raises(SubBlockPoolExhausted, match="accounting rule"):
        store.grow(1, one, yes, yes, row[None], frozen, 1, True)


def test_pooled_mode_refuses_what_it_does_not_serve() -> None:
    pooled = SubBlockStore(2, 2, 16, width=4, capacity=1, device="cpu", layer_blocks=8)
    row = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="split"):
        pooled.split_groups(2)
    with pytest.raises(ValueError, match="shared"):
        BatchSubBlocks(2, 2, 16, shared=True, layer_blocks=8)
    with pytest.raises(ValueError, match="layer_blocks"):
        SubBlockStore(2, 2, 16, width=4, capacity=1, device="cpu", layer_blocks=-1)
    plain = SubBlockStore(2, 2, 16, width=4, capacity=1, device="cpu")
    with pytest.raises(ValueError, match="pool_start"):
        plain.assign(torch.tensor([4, 4]), row, 1, 0, 8, 4, True, pool_start=2)
    with pytest.raises(ValueError, match="group"):
        plain.assign(torch.tensor([4, 4]), row, 1, 0, 8, 4, True, group=1)
    table = plain.assign(torch.tensor([4, 4]), row, 1, 0, 8, 4, True)
    with pytest.raises(ValueError, match="pool_cursor"):
        plain.commit(0, 0, table, 1, pool_cursor=2)
    assert plain.pool_cursor.numel() == 0 and "pool_cursor" not in plain.save(torch.tensor([0]))
