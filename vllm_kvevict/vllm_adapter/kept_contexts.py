"""Scheduler side of kept contexts (``layout/context_reuse.py``): compacted contexts as entries of vLLM's
prefix cache.

An entry is the m blocks a creator's context fills. They enter vLLM's block pool under hashes no block of
tokens can have (sha256 of a marker, the setting's identity, vLLM's chain hash of the context's last block,
and the block's index), so they outlive the creator as ordinary cached blocks: free, evictable, reclaimed
LRU by the pool like any other. Reclaiming a block resets its hash, and an entry is served only while each
of its blocks still carries the hash it was given, so a reader never receives a reclaimed block. The chain
hash covers the context's token ids and vLLM's extra keys (``cache_salt``, LoRA), the identity the method,
budget and parameters: a request with another setting, another salt or a full-KV request never finds the
entry (full-KV requests look up token hashes only).

Registers a block under a hash as ``cache_full_blocks`` does (``vllm_private.insert_block_hash``, a private
part of vLLM 0.32.0's ``BlockPool``) and reads ``KVCacheBlock.block_hash`` (reset when the pool reclaims a
block).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id, resolve_block_hashes

from vllm_kvevict.vllm_adapter.vllm_private import insert_block_hash

_MARKER = b"vllm-kvevict kept context\x00"


@dataclass
class KeptContext:
    """One entry: ``blocks`` (vLLM ``KVCacheBlock``s, in pool order) each registered under ``hashes``."""

    context_tokens: int
    blocks: list[Any]
    hashes: list[bytes]

    def intact(self) -> bool:
        """True while no block was reclaimed by the pool (each still carries its entry hash)."""
        return all(block.block_hash == h for block, h in zip(self.blocks, self.hashes, strict=True))


class KeptContexts:
    """The kept contexts of one KV-cache group, keyed by (setting identity, chain hash of the context)."""

    def __init__(self, block_pool: Any, block_size: int, group_id: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.group_id = group_id
        self.entries: dict[tuple[str, bytes], KeptContext] = {}

    def chain_hash(self, block_hashes: Sequence[Any], context_tokens: int) -> bytes | None:
        """vLLM's hash of a request's block ending at ``context_tokens`` (None: not hashed)."""
        hashes = resolve_block_hashes(block_hashes, self.block_pool.hash_block_size, self.block_size)
        index = context_tokens // self.block_size - 1
        return bytes(hashes[index]) if 0 <= index < len(hashes) else None

    def lookup(self, identity: str, block_hashes: Sequence[Any], max_tokens: int) -> KeptContext | None:
        """The longest intact entry of ``identity`` whose context is a prefix of the request (its block
        hashes) of at most ``max_tokens`` tokens; a broken entry met on the way is dropped."""
        lengths = sorted({e.context_tokens for (ident, _), e in self.entries.items() if ident == identity})
        for tokens in reversed(lengths):
            if tokens > max_tokens:
                continue
            chain = self.chain_hash(block_hashes, tokens)
            if chain is None:
                continue
            key = (identity, chain)
            entry = self.entries.get(key)
            if entry is None:
                continue
            if entry.intact():
                return entry
            del self.entries[key]
        return None

    def publish(self, identity: str, chain: bytes, context_tokens: int, blocks: Sequence[Any]) -> bool:
        """Register ``blocks`` (a creator's context blocks, never hashed) as the entry of ``identity`` and
        ``chain``; False when an intact entry exists already or a block is not fit to be one."""
        key = (identity, chain)
        existing = self.entries.get(key)
        if existing is not None and existing.intact():
            return False
        if not blocks or any(block.is_null or block.block_hash is not None for block in blocks):
            return False
        self._drop_broken()
        hashes = [self._entry_hash(identity, chain, i) for i in range(len(blocks))]
        for block, block_hash in zip(blocks, hashes, strict=True):
            insert_block_hash(self.block_pool, block_hash, block)
        self.entries[key] = KeptContext(context_tokens, list(blocks), hashes)
        return True

    def _entry_hash(self, identity: str, chain: bytes, index: int) -> bytes:
        digest = hashlib.sha256(
            _MARKER + identity.encode() + b"\x00" + chain + index.to_bytes(4, "big")
        ).digest()
        return make_block_hash_with_group_id(digest, self.group_id)

    def _drop_broken(self) -> None:
        """Forget entries the pool has reclaimed a block of (keeps the registry as small as the cache)."""
        for key in [key for key, entry in self.entries.items() if not entry.intact()]:
            del self.entries[key]
