"""Paged KV block allocator with reference counts and (optional) prefix caching. Pure Python.

A sequence's KV lives in fixed-size blocks ("pages") listed in its block tables, one per layer
group (``kv_layout.KVLayout``; a model without windows, or with one window on every layer, has
one group and one table, ``seq.block_table``). The KV of token ``p`` for the layers of group ``g``
is in slot ``block_tables[g][p // block_size] * block_size + p % block_size`` of their storage
tensors. All groups draw their pages from one free list.

Prefix caching: every full block gets a hash chained over all tokens before it, the
adapter's content hash and the request's cache salt (``h_i = sha256(h_{i-1} || tokens of block
i)``, ``h_{-1} = sha256(adapter_id || cache_salt)``), so two sequences share a block only when
the adapter, the salt and every earlier token are the same. An adapter whose LoRA cannot change
any K/V (``Sequence.shares_base_kv``: LoRA only on lm_head and the last layer's modules after its
K/V, see ``lora/kv_effect.py``) computes the base model's K/V, so its blocks are keyed as the
base model's (``adapter_id`` left out of the root; the salt kept). The salt keeps users apart
(vLLM's ``cache_salt``): a hit is faster than a miss, and without it anyone could time whether another
user's prompt is cached. A page is cached under its group and hash (group 0 under the hash
alone), as if the group were part of the chain's root, without hashing the tokens once per group.
A new sequence whose leading full blocks are already cached takes them by reference count instead
of recomputing them. Cached pages that no sequence uses stay "evictable": they count as free, and
are reused (LRU) only when the free list is empty.

A block is registered when it is *scheduled* to become full, not after the step that fills it:
the model writes every scheduled token's K/V into the cache before any attention of the same
layer reads it, so a sequence admitted later in the same step can already share it. Requests
arriving together with a common prefix (a chat template's system prompt) compute it once.
Registration is undone when the sequence is freed before the step ran (preempted later in the
same scheduling pass); ``seq.num_computed_tokens`` tells which of its blocks are computed.

Sliding window (a group whose layers all attend within ``window``): the next chunk, starting at
position ``s = num_computed_tokens``, reads keys from ``s - window + 1`` on, so the blocks wholly
before that are never read again by that group's layers. ``release_out_of_window`` gives them
back (a cached one stays findable for other sequences' prefixes, as any freed cached block) and
puts ``FREED_BLOCK`` in their table entries, so entry ``i`` still stands for tokens
``i * block_size`` onwards; the attention kernels never read an entry before the window. A
windowed table thus holds at most ``ceil((window - 1) / block_size) + 1`` pages plus those of the
chunk it computes, while a global group's table keeps the whole context. All of a sequence's
tables have the same length (a freed entry stays in place). A prefix hit of ``k`` blocks needs
every global group's first ``k`` blocks cached, and of each windowed group only the blocks its
first chunk reads (the head blocks, given back first, are the first evicted).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

from loraplex.engine.sequence import Sequence

# a block-table entry whose block slid out of the window and went back to the pool
FREED_BLOCK = -1


def peak_blocks_per_sequence(max_model_len: int, block_size: int, sliding_window: int | None,
                             max_chunk_tokens: int | None) -> int:
    """The most blocks one sequence of a one-group model holds at once (the general case with
    layer groups is ``KVLayout.peak_pages_per_sequence``): its whole context, or, when every
    layer is windowed and prompts are computed in chunks of at most ``max_chunk_tokens``, the
    window's blocks plus the chunk's."""
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


def _cache_key(chain_hash: bytes, group: int) -> bytes:
    """Where group ``group``'s page of a block is cached: a 32-byte chain hash never equals a
    longer key, so groups cannot collide."""
    return chain_hash if group == 0 else chain_hash + group.to_bytes(2, "little")


def _out_of_window(window: int | None, num_computed_tokens: int, block_size: int) -> int:
    if window is None:
        return 0
    return max(0, num_computed_tokens - window + 1) // block_size


class BlockManager:
    """Free list + reference counts over ``num_blocks`` pages of ``block_size`` tokens, shared
    by the layer groups whose windows ``group_windows`` lists (default: one group attending
    within ``sliding_window``, None = the whole context)."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, sliding_window: int | None = None,
        group_windows: tuple[int | None, ...] | None = None,
    ):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if group_windows is None:
            group_windows = (sliding_window,)
        elif sliding_window is not None:
            raise ValueError("give sliding_window or group_windows, not both")
        if not group_windows or any(w is not None and w < 1 for w in group_windows):
            raise ValueError("sliding_window must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)
        self.num_groups = len(self.group_windows)
        # every group's window when they share one; None: some layers keep every block for life
        first = self.group_windows[0]
        self.sliding_window = first if all(w == first for w in self.group_windows) else None
        self._windowed = [(g, w) for g, w in enumerate(self.group_windows) if w is not None]
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_count = [0] * num_blocks
        # prefix cache: key -> page, page -> key, and unused cached pages in LRU order
        self._cached: dict[bytes, int] = {}
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._evictable: OrderedDict[int, None] = OrderedDict()
        # seq_id -> how many of that sequence's leading full blocks are registered
        self._num_registered: dict[int, int] = {}

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of pages held by sequences (cached-but-unused pages count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def ref_count(self, block: int) -> int:
        return self._ref_count[block]

    def num_out_of_window(self, num_computed_tokens: int, group: int = 0) -> int:
        """Leading blocks of ``group`` no chunk starting at ``num_computed_tokens`` (or later)
        reads: those wholly before its first query's window, positions
        ``< num_computed_tokens - window + 1``."""
        return _out_of_window(self.group_windows[group], num_computed_tokens, self.block_size)

    def pages_held(self, seq: Sequence) -> int:
        """Table entries of ``seq`` that hold a page (over all groups)."""
        return sum(1 for table in seq.block_tables for b in table if b != FREED_BLOCK)

    # ---- prefix cache lookup ---------------------------------------------------------------
    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chain hashes of ``seq``'s first ``num_blocks`` full blocks (at least), computed
        once per sequence: a waiting sequence is looked up every step it stays blocked."""
        hashes = seq.block_hashes
        # an adapter that cannot change K/V computes the base model's: keyed as the base's
        if hashes:
            parent = hashes[-1]
        else:
            parent = _root_hash(None if seq.shares_base_kv else seq.adapter_id, seq.cache_salt)
        for i in range(len(hashes), num_blocks):
            parent = _chain_hash(parent, seq.token_slice(i * self.block_size, (i + 1) * self.block_size))
            hashes.append(parent)
        return hashes

    def reads_prefix_cache(self, seq: Sequence) -> bool:
        """Whether ``seq``'s cached prefix is looked up (vLLM's ``prefix_cache_lookup_enabled``):
        not while it still needs prompt logprobs, which need its whole prompt computed."""
        return self.enable_prefix_caching and not seq.needs_prompt_logprobs

    def _prefix_hits(self, seq: Sequence) -> list[list[int]]:
        """Per group, the cached pages matching ``seq``'s leading full blocks (all groups the
        same number of entries); at least one token is left to compute so the step that admits
        it can sample from real logits. A global group needs every block up to the hit cached;
        a windowed one only the blocks the first chunk reads (the entries before them are
        ``FREED_BLOCK``): a windowed sequence gives its head blocks back first, so they are the
        least recently used and evicted first, while the blocks after them stay findable."""
        none: list[list[int]] = [[] for _ in range(self.num_groups)]
        if not self.reads_prefix_cache(seq):
            return none
        limit = (seq.num_tokens - 1) // self.block_size
        hashes = self._block_hashes(seq, limit)
        cached = self._cached
        rows: list[list[int]] = [[] for _ in range(self.num_groups)]
        for g, window in enumerate(self.group_windows):
            if window is None:  # the cached prefix: up to the first miss
                row = rows[g]
                for i in range(limit):
                    block = cached.get(_cache_key(hashes[i], g))
                    if block is None:
                        break
                    row.append(block)
                limit = len(row)
        if not self._windowed:
            return [row[:limit] for row in rows]
        # windowed groups: from the longest candidate down, look up only the blocks its first
        # chunk reads (and at least the last one), each block at most once
        looked_up: dict[tuple[int, int], int | None] = {}
        k = limit
        while k > 0:
            miss = -1
            for g, window in self._windowed:
                first = min(_out_of_window(window, k * self.block_size, self.block_size), k - 1)
                for i in range(k - 1, first - 1, -1):
                    if (g, i) not in looked_up:
                        looked_up[g, i] = cached.get(_cache_key(hashes[i], g))
                    if looked_up[g, i] is None:
                        miss = i
                        break
                if miss >= 0:
                    break
            if miss < 0:
                hits = []
                for g, window in enumerate(self.group_windows):
                    if window is None:
                        hits.append(rows[g][:k])
                    else:
                        skipped = _out_of_window(window, k * self.block_size, self.block_size)
                        hits.append([FREED_BLOCK] * skipped + [looked_up[g, i] for i in range(skipped, k)])
                return hits
            # every shorter candidate whose read blocks include the missing one fails too: the
            # read span's start only moves back as the candidate shrinks
            k = miss
        return none

    def num_cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens of a not-yet-allocated ``seq`` that ``allocate`` would take from the cache."""
        return len(self._prefix_hits(seq)[0]) * self.block_size

    # ---- allocation ------------------------------------------------------------------------
    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Can a sequence without blocks get its cached prefix plus ``num_new_tokens`` more?"""
        hits = self._prefix_hits(seq)
        num_hit = len(hits[0])
        need = (self.blocks_for(num_hit * self.block_size + num_new_tokens) - num_hit) * self.num_groups
        # hit pages that sit in the evictable pool stop being free once taken (those before a
        # window are not taken)
        taken_from_free = sum(1 for row in hits for b in row if b != FREED_BLOCK and self._ref_count[b] == 0)
        return need + taken_from_free <= self.num_free_blocks

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Give ``seq`` (which holds no blocks) its cached prefix and blocks for
        ``num_new_tokens`` more; sets ``seq.num_computed_tokens`` to the cached length."""
        if any(seq.block_tables):
            raise RuntimeError(f"sequence {seq.seq_id} already holds blocks")
        hits = self._prefix_hits(seq)
        num_hit = len(hits[0])
        for row in hits:
            for block in row:  # the hits before the first chunk's window are computed but never read
                if block != FREED_BLOCK:
                    if self._ref_count[block] == 0:
                        self._evictable.pop(block, None)
                    self._ref_count[block] += 1
        seq.block_tables = hits
        seq.num_computed_tokens = num_hit * self.block_size
        if self.enable_prefix_caching:
            self._num_registered[seq.seq_id] = num_hit
        self.append(seq, num_new_tokens)

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_tables[0])
        if need <= 0:  # most decode steps: the last block has room
            return True
        return need * self.num_groups <= self.num_free_blocks + self._num_releasable(seq)

    def append(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow ``seq``'s tables to hold its computed tokens plus ``num_new_tokens`` (after
        giving back the blocks that slid out of a window)."""
        self.release_out_of_window(seq)
        tables = seq.block_tables
        need = self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(tables[0])
        if need > 0:  # most decode steps: the last block has room
            if need * self.num_groups > self.num_free_blocks:
                raise RuntimeError(f"out of KV blocks: need {need * self.num_groups}, free {self.num_free_blocks}")
            for table in tables:
                for _ in range(need):
                    table.append(self._take_block())
        if self.enable_prefix_caching:
            # a speculative step's draft tokens are not the sequence's (yet): only the blocks
            # its known tokens fill are registered (the accepted ones, by drop_uncomputed_blocks)
            self._register(seq, min(seq.num_computed_tokens + num_new_tokens, seq.num_tokens))

    def drop_uncomputed_blocks(self, seq: Sequence) -> int:
        """After a speculative step: give back the blocks past ``seq.num_computed_tokens``
        (they held only rejected draft tokens; never registered, see ``append``), and register
        the blocks the accepted tokens filled. Returns how many pages went back."""
        keep = self.blocks_for(seq.num_computed_tokens)
        dropped = 0
        for table in seq.block_tables:
            while len(table) > keep:
                block = table.pop()
                self._unregister(block)
                self._release(block)
                dropped += 1
        if dropped:
            seq.block_tables_version += 1  # entries removed in place (Sequence.block_tables_version)
        if self.enable_prefix_caching:
            self._register(seq, seq.num_computed_tokens)
        return dropped

    def _num_releasable(self, seq: Sequence) -> int:
        """Pages ``release_out_of_window`` would add to the free count (shared ones stay held)."""
        count = 0
        for g, window in self._windowed:
            table = seq.block_tables[g]
            end = min(_out_of_window(window, seq.num_computed_tokens, self.block_size), len(table))
            for i in range(end - 1, -1, -1):
                if table[i] == FREED_BLOCK:
                    break  # released entries are always a prefix of the table
                count += self._ref_count[table[i]] == 1
        return count

    def release_out_of_window(self, seq: Sequence) -> int:
        """Give back ``seq``'s pages that no chunk from ``seq.num_computed_tokens`` on reads
        (their entries become ``FREED_BLOCK``); returns how many entries were released."""
        released = 0
        for g, window in self._windowed:  # none for a model without windows (called twice a step)
            table = seq.block_tables[g]
            end = min(_out_of_window(window, seq.num_computed_tokens, self.block_size), len(table))
            start = end
            while start > 0 and table[start - 1] != FREED_BLOCK:
                start -= 1
            for i in range(start, end):
                self._release(table[i])
                table[i] = FREED_BLOCK
            released += end - start
        if released:
            seq.block_tables_version += 1  # entries changed in place (Sequence.block_tables_version)
        return released

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
        else:  # reuse the least recently used cached page nobody holds
            block, _ = self._evictable.popitem(last=False)
            self._unregister(block)
        self._ref_count[block] = 1
        return block

    def _register(self, seq: Sequence, num_tokens: int) -> None:
        """Register the full blocks among ``seq``'s first ``num_tokens`` tokens (those this step
        computes included) in the prefix cache, in every group."""
        tables = seq.block_tables
        num_full = min(num_tokens // self.block_size, len(tables[0]))
        num_registered = self._num_registered.get(seq.seq_id, 0)
        if num_full <= num_registered:
            return
        hashes = self._block_hashes(seq, num_full)
        for g, table in enumerate(tables):
            for i in range(num_registered, num_full):
                block = table[i]
                if block == FREED_BLOCK:  # registered when scheduled, before it could slide out
                    continue
                # the first page scheduled for a given content is the one others will share
                key = _cache_key(hashes[i], g)
                if key not in self._cached and self._block_hash[block] is None:
                    self._cached[key] = block
                    self._block_hash[block] = key
        self._num_registered[seq.seq_id] = num_full

    def _unregister(self, block: int) -> None:
        old_key = self._block_hash[block]
        if old_key is not None and self._cached.get(old_key) == block:
            del self._cached[old_key]
        self._block_hash[block] = None

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s hold on its pages (at once); cached ones stay reusable."""
        tables = seq.block_tables
        # blocks registered for a step that has not run hold no K/V yet: nobody may find them
        # (out-of-window entries all lie before num_computed_tokens: computed, released already)
        first_uncomputed = seq.num_computed_tokens // self.block_size
        for table in tables:
            for block in table[first_uncomputed:]:
                self._unregister(block)
        # release back to front, so a prefix's tail pages are evicted before its head
        for i in range(len(tables[0]) - 1 if tables else -1, -1, -1):
            for table in tables:
                if table[i] != FREED_BLOCK:
                    self._release(table[i])
        seq.block_tables = []
        self._num_registered.pop(seq.seq_id, None)

    def reset_prefix_cache(self) -> None:
        """Forget every cached page nobody holds (a benchmark round that must start cold)."""
        for block in list(self._evictable):
            self._unregister(block)
            self._free.append(block)
        self._evictable.clear()
