"""Paged KV-cache bookkeeping: fixed-size blocks, block tables, ref counts and prefix caching (no torch).

A sequence's token at position ``p`` lives in slot ``block_table[p // block_size] * block_size +
p % block_size`` of the pool. A *full* block whose KV has been computed is registered under a chained
hash (its tokens plus the previous block's hash), so a later request with the same prefix shares it
(ref count + 1) instead of recomputing it. Freed blocks keep their hash and content until they are
handed out again: the free list is least-recently-freed first, unhashed blocks ahead of cached ones.
Blocks are registered only once their KV exists (``commit``), so nothing can read a block that a
running forward is still filling.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from runtime.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: bytes | None = None
        self.token_ids: tuple[int, ...] = ()


def chain_hash(prev: bytes | None, token_ids) -> bytes:
    """Hash of one full block given the previous block's hash (None for the first block)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(prev or b"\0" * 16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class BlockManager:
    """Hands out KV blocks to sequences and shares full prefix blocks between them."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks >= 1 and block_size >= 1
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.hit_tokens = 0  # prefix-cache statistics over all admissions
        self.queried_tokens = 0

    # --- queries --------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _hashes(self, seq: Sequence, n_blocks: int) -> list[bytes]:
        """The chained hashes of the first ``n_blocks`` full blocks of ``seq`` (cached on it)."""
        bs, hashes = self.block_size, seq.block_hashes
        while len(hashes) < n_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:n_blocks]

    def _match(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq``; the last token is always left to compute."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:  # scoring computes every position
            return []
        bs, matched = self.block_size, []
        for i, h in enumerate(self._hashes(seq, (seq.num_tokens - 1) // bs)):
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(seq.token_ids[i * bs:(i + 1) * bs]):
                break
            matched.append(bid)
        return matched

    def can_allocate(self, seq: Sequence) -> bool:
        """Whether all of ``seq``'s tokens (prefix hits included) fit in the free blocks now."""
        matched = self._match(seq)
        revived = sum(self.blocks[b].ref_count == 0 for b in matched)
        return self.blocks_for(seq.num_tokens) - len(matched) + revived <= len(self.free_ids)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Whether slots for ``num_new_tokens`` past the computed tokens can be provided."""
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free_ids)

    # --- changes --------------------------------------------------------------------------------
    def _take_free(self, block_id: int | None = None) -> int:
        """Remove a block from the free list (the oldest one unless named), forgetting its hash."""
        if block_id is None:
            block_id, _ = self.free_ids.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.hash_to_block.get(block.hash) == block_id:
                    del self.hash_to_block[block.hash]
                block.hash, block.token_ids = None, ()
        else:
            del self.free_ids[block_id]
        block = self.blocks[block_id]
        assert block.ref_count == 0
        block.ref_count = 1
        return block_id

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_ids[block_id] = None
            if block.hash is None:  # nothing worth keeping: hand it out first
                self.free_ids.move_to_end(block_id, last=False)

    def allocate(self, seq: Sequence) -> None:
        """Give a waiting ``seq`` blocks for all its tokens, reusing cached prefix blocks."""
        assert not seq.block_table, f"{seq.request_id} already holds blocks"
        matched = self._match(seq)
        for bid in matched:
            if self.blocks[bid].ref_count == 0:
                self._take_free(bid)
            else:
                self.blocks[bid].ref_count += 1
        fresh = [self._take_free() for _ in range(self.blocks_for(seq.num_tokens) - len(matched))]
        seq.block_table = matched + fresh
        cached = len(matched) * self.block_size
        seq.num_computed_tokens = seq.num_draft_computed = seq.num_cached_tokens = cached
        seq.num_hashed_blocks = len(matched)
        self.hit_tokens += cached
        self.queried_tokens += seq.num_tokens

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq``'s block table to hold ``num_new_tokens`` past its computed tokens."""
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        assert need <= len(self.free_ids), "append_slots without can_append"
        seq.block_table.extend(self._take_free() for _ in range(need))

    def commit(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among the first ``num_tokens`` (KV computed) for prefix reuse."""
        if not self.enable_prefix_caching:
            return
        full = min(num_tokens, seq.num_tokens) // self.block_size
        bs = self.block_size
        for i, h in enumerate(self._hashes(seq, full)[seq.num_hashed_blocks:], start=seq.num_hashed_blocks):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and h not in self.hash_to_block:
                block.hash, block.token_ids = h, tuple(seq.token_ids[i * bs:(i + 1) * bs])
                self.hash_to_block[h] = block.block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, full)

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        """Release the trailing blocks not needed to hold ``num_tokens`` tokens (speculative rollback)."""
        keep = max(self.blocks_for(num_tokens), seq.num_hashed_blocks)
        for bid in reversed(seq.block_table[keep:]):
            self._release(bid)
        del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks (tail first, so shared prefixes stay cached longest)."""
        for bid in reversed(seq.block_table):
            self._release(bid)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_draft_computed = seq.num_hashed_blocks = 0

    def check_invariants(self, live: list[Sequence]) -> None:
        """Assert that ref counts equal the block-table references (used by tests)."""
        refs = [0] * self.num_blocks
        for seq in live:
            for bid in seq.block_table:
                refs[bid] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], (block.block_id, block.ref_count, refs[block.block_id])
            assert (block.ref_count == 0) == (block.block_id in self.free_ids)
        for h, bid in self.hash_to_block.items():
            assert self.blocks[bid].hash == h
