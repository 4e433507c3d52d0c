"""Paged KV block allocator with reference counts and (optional) prefix caching. Pure Python.

A sequence's KV lives in fixed-size blocks listed in ``seq.block_table``; the KV of token ``p``
is in slot ``block_table[p // block_size] * block_size + p % block_size``.

Prefix caching: every full block gets a hash chained over all tokens before it, the
adapter's content hash and the request's cache salt (``h_i = sha256(h_{i-1} || tokens of block
i)``, ``h_{-1} = sha256(adapter_id || cache_salt)``), so two sequences share a block only when
the adapter, the salt and every earlier token are the same. The salt keeps users apart (vLLM's
``cache_salt``): a hit is faster than a miss, and without it anyone could time whether another
user's prompt is cached. A new sequence whose leading full blocks are already cached takes them by
reference count instead of recomputing them. Cached blocks that no sequence uses stay
"evictable": they count as free, and are reused (LRU) only when the free list is empty.

A block is registered when it is *scheduled* to become full, not after the step that fills it:
the model writes every scheduled token's K/V into the cache before any attention of the same
layer reads it, so a sequence admitted later in the same step can already share it. Requests
arriving together with a common prefix (a chat template's system prompt) compute it once.
Registration is undone when the sequence is freed before the step ran (preempted later in the
same scheduling pass); ``seq.num_computed_tokens`` tells which of its blocks are computed.

Sliding window (``sliding_window``, for a model whose every layer attends within the same window):
the next chunk, starting at position ``s = num_computed_tokens``, reads keys from ``s - window + 1``
on, so the blocks wholly before that are never read again. ``release_out_of_window`` gives them
back (a cached one stays findable for other sequences' prefixes, as any freed cached block) and
puts ``FREED_BLOCK`` in their table entries, so block ``i`` still holds tokens ``i * block_size``
onwards; the attention kernels never read an entry before the window. A sequence thus holds at
most ``ceil((window - 1) / block_size) + 1`` blocks plus those of the chunk it computes. A prefix
hit needs cached only the blocks its first chunk reads, not the whole chain from block 0 (the
head blocks, given back first, are the first evicted).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

from loraplex.engine.sequence import Sequence

# a block-table entry whose block slid out of the window and went back to the pool
FREED_BLOCK = -1


def peak_blocks_per_sequence(max_model_len: int, block_size: int, sliding_window: int | None,
                             max_chunk_tokens: int | None) -> int:
    """The most blocks one sequence holds at once: its whole context, or, when every layer is
    windowed and prompts are computed in chunks of at most ``max_chunk_tokens``, the window's
    blocks plus the chunk's (a span of ``window - 1 + chunk`` positions, over one block more when
    it does not start at a block's first slot). Without chunks a prompt is computed whole."""
    whole = -(-max_model_len // block_size)
    if sliding_window is None or max_chunk_tokens is None:
        return whole
    return min(whole, -(-(sliding_window - 1 + max_chunk_tokens) // block_size) + 1)


def _root_hash(adapter_id: str | None, cache_salt: str | None) -> bytes:
    digest = hashlib.sha256(b"loraplex-kv|" + (adapter_id or "").encode())
    if cache_salt is not None:
        # surrogatepass: any str is a salt (the offline API takes what it is given); one that is not
        # UTF-8 text would otherwise raise inside the scheduler and stop the engine loop
        digest.update(b"|salt|" + cache_salt.encode("utf-8", "surrogatepass"))
    return digest.digest()


def _chain_hash(parent: bytes, tokens: list[int]) -> bytes:
    digest = hashlib.sha256(parent)
    digest.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    return digest.digest()


class BlockManager:
    """Free list + reference counts over ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, sliding_window: int | None = None
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window  # every layer's window; None: blocks are kept for life
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks
        # prefix cache: hash -> block, block -> hash, and unused cached blocks in LRU order
        self._cached: dict[bytes, int] = {}
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # seq_id -> how many of that sequence's leading full blocks are registered
        self._num_registered: dict[int, int] = {}
        self.num_prefix_hit_tokens = 0  # counters for stats
        self.num_prefix_query_tokens = 0

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by sequences (cached-but-unused blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]

    def num_out_of_window(self, num_computed_tokens: int) -> int:
        """Leading blocks no chunk starting at ``num_computed_tokens`` (or later) reads: those
        wholly before its first query's window, positions ``< num_computed_tokens - window + 1``."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed_tokens - self.sliding_window + 1) // self.block_size

    # ---- prefix cache lookup ---------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain hashes of ``seq``'s first ``num_blocks`` full blocks (at least), computed
        once per sequence: a waiting sequence is looked up every step it stays blocked."""
        hashes = seq.block_hashes
        parent = hashes[-1] if hashes else _root_hash(seq.adapter_id, seq.cache_salt)
        for i in range(len(hashes), num_blocks):
            parent = _chain_hash(parent, seq.token_slice(i * self.block_size, (i + 1) * self.block_size))
            hashes.append(parent)
        return hashes

    def _prefix_hits(self, seq: Sequence) -> list[int]:
        """Cached blocks matching ``seq``'s leading full blocks; at least one token is left to
        compute so the step that admits it can sample from real logits. With a sliding window
        only the blocks the first chunk reads must be cached (the entries before them are
        ``FREED_BLOCK``): a windowed sequence gives its head blocks back first, so they are the
        least recently used and evicted first, while the blocks after them stay findable."""
        if not self.enable_prefix_caching or seq.needs_prompt_logprobs:
            return []
        max_blocks = (seq.num_tokens - 1) // self.block_size
        cached = [self._cached.get(h) for h in self._block_hashes(seq, max_blocks)[:max_blocks]]
        if self.sliding_window is None:
            return cached[: cached.index(None)] if None in cached else cached
        run = 0  # cached blocks in a row ending at block k - 1
        runs = []
        for block in cached:
            run = run + 1 if block is not None else 0
            runs.append(run)
        for k in range(max_blocks, 0, -1):
            skipped = self.num_out_of_window(k * self.block_size)
            if runs[k - 1] >= max(1, k - skipped):  # the read blocks, and at least the last one
                return [FREED_BLOCK] * skipped + cached[skipped:k]
        return []

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of a not-yet-allocated ``seq`` that ``allocate`` would take from the cache."""
        return len(self._prefix_hits(seq)) * self.block_size

    # ---- allocation ------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Can a sequence without blocks get its cached prefix plus ``num_new_tokens`` more?"""
        hits = self._prefix_hits(seq)
        need = self.blocks_for(len(hits) * self.block_size + num_new_tokens) - len(hits)
        # hit blocks that sit in the evictable pool stop being free once taken (those before the
        # window are not taken)
        skipped = self.num_out_of_window(len(hits) * self.block_size)
        taken_from_free = sum(1 for b in hits[skipped:] if self._ref_count[b] == 0)
        return need + taken_from_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` (which holds no blocks) its cached prefix and blocks for
        ``num_new_tokens`` more; sets ``seq.num_computed_tokens`` to the cached length."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        hits = self._prefix_hits(seq)
        if self.enable_prefix_caching:
            self.num_prefix_query_tokens += seq.num_tokens
            self.num_prefix_hit_tokens += len(hits) * self.block_size
        # the hits before the first chunk's window are computed but never read: not taken
        skipped = self.num_out_of_window(len(hits) * self.block_size)
        for block in hits[skipped:]:
            if self._ref_count[block] == 0:
                self._evictable.pop(block, None)
            self._ref_count[block] += 1
        seq.block_table = [FREED_BLOCK] * skipped + hits[skipped:]
        seq.num_computed_tokens = len(hits) * self.block_size
        if self.enable_prefix_caching:
            self._num_registered[seq.seq_id] = len(hits)
        self.append(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need <= 0:  # most decode steps: the last block has room
            return True
        return need <= self.num_free_blocks + self._num_releasable(seq)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold its computed tokens plus ``num_new_tokens`` (after
        giving back the blocks that slid out of the window)."""
        self.release_out_of_window(seq)
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        if need > 0:  # most decode steps: the last block has room
            if need > self.num_free_blocks:
                raise RuntimeError(f"out of KV blocks: need {need}, free {self.num_free_blocks}")
            for _ in range(need):
                seq.block_table.append(self._take_block())
        if self.enable_prefix_caching:
            # a speculative step's draft tokens are not the sequence's (yet): only the blocks
            # its known tokens fill are registered (the accepted ones, by drop_uncomputed_blocks)
            self._register(seq, min(seq.num_computed_tokens + num_new_tokens, seq.num_tokens))

    def drop_uncomputed_blocks(self, seq: Sequence) -> int:
        """After a speculative step: give back the blocks past ``seq.num_computed_tokens``
        (they held only rejected draft tokens; never registered, see ``append``), and register
        the blocks the accepted tokens filled. Returns how many blocks went back."""
        keep = self.blocks_for(seq.num_computed_tokens)
        dropped = 0
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self._unregister(block)
            self._release(block)
            dropped += 1
        if self.enable_prefix_caching:
            self._register(seq, seq.num_computed_tokens)
        return dropped

    def _num_releasable(self, seq: Sequence) -> int:
        """Blocks ``release_out_of_window`` would add to the free count (shared ones stay held)."""
        table = seq.block_table
        count = 0
        for i in range(min(self.num_out_of_window(seq.num_computed_tokens), len(table)) - 1, -1, -1):
            if table[i] == FREED_BLOCK:
                break  # released entries are always a prefix of the table
            count += self._ref_count[table[i]] == 1
        return count

    def release_out_of_window(self, seq: Sequence) -> int:
        """Give back ``seq``'s blocks that no chunk from ``seq.num_computed_tokens`` on reads
        (their entries become ``FREED_BLOCK``); returns how many entries were released."""
        if self.sliding_window is None:  # called for every scheduled sequence twice a step
            return 0
        table = seq.block_table
        end = min(self.num_out_of_window(seq.num_computed_tokens), len(table))
        start = end
        while start > 0 and table[start - 1] != FREED_BLOCK:
            start -= 1
        for i in range(start, end):
            self._release(table[i])
            table[i] = FREED_BLOCK
        return end - start

    def _release(self, block: int) -> None:
        self._ref_count[block] -= 1
        if self._ref_count[block] < 0:
            raise RuntimeError(f"block {block} freed twice")
        if self._ref_count[block] == 0:
            if self._block_hash[block] is not None:
                self._evictable[block] = None
            else:
                self._free.append(block)

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:  # reuse the least recently used cached block nobody holds
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
        self._ref_count[block] = 1
        return block

    def _register(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among ``seq``'s first ``num_tokens`` tokens (those this step
        computes included) in the prefix cache."""
        num_full = min(num_tokens // self.block_size, len(seq.block_table))
        num_registered = self._num_registered.get(seq.seq_id, 0)
        if num_full <= num_registered:
            return
        hashes = self._block_hashes(seq, num_full)
        for i in range(num_registered, num_full):
            block = seq.block_table[i]
            if block == FREED_BLOCK:  # registered when scheduled, before it could slide out
                continue
            # the first block scheduled for a given content is the one others will share
            if hashes[i] not in self._cached and self._block_hash[block] is None:
                self._cached[hashes[i]] = block
                self._block_hash[block] = hashes[i]
        self._num_registered[seq.seq_id] = num_full

    def _unregister(self, block: int) -> None:
        old_hash = self._block_hash[block]
        if old_hash is not None and self._cached.get(old_hash) == block:
            del self._cached[old_hash]
        self._block_hash[block] = None

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its blocks (at once); cached ones stay reusable."""
        # blocks registered for a step that has not run hold no K/V yet: nobody may find them
        # (out-of-window entries all lie before num_computed_tokens: computed, released already)
        for block in seq.block_table[seq.num_computed_tokens // self.block_size :]:
            self._unregister(block)
        # release in reverse so a prefix's tail blocks are evicted before its head
        for block in reversed(seq.block_table):
            if block != FREED_BLOCK:
                self._release(block)
        seq.block_table = []
        self._num_registered.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody holds (a benchmark round that must start cold)."""
        for block in list(self._evictable):
            self._unregister(block)
            self._free.append(block)
        self._evictable.clear()
