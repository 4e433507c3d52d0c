"""Paged attention for CPU tensors, batched for speed (``attention_ref`` stays the oracle).

Same arguments and result as ``attention_ref``. Decode rows (one query token) of all sequences
run as one ``scaled_dot_product_attention`` over K/V gathered through the block tables, with a
key-padding mask. Prompt chunks are grouped by size and each group runs as one padded call with
a mask that is causal and shifted by each chunk's cached prefix: a call per sequence costs about
0.2 ms of fixed overhead, which for 64 short prompts over 30 layers is as much as the math.

Everything that depends only on the step's metadata (groups, gather indices, masks, row maps)
is an ``AttentionPlan``, built once per step and reused by every layer. With a sliding window a
group gathers only the blocks its rows' windows reach, from the block of ``first query - window
+ 1`` on (built on first use per window size and kept in the group, so layers of one window type
share it): a long context's windowed layers cost the window, not the context, and block-table
entries before the window (freed by the block manager, see ``block_manager.FREED_BLOCK``) are
never read. Logit soft-capping runs the scores through tanh, which SDPA cannot, so those calls
compute the softmax written out. A layer's KV-cache scales (``kv_quant``) cost no pass over the
gathered K/V: ``k_scale`` joins the softmax scale and ``v_scale`` multiplies the output.

Padding gathers keys no real query of the row may attend (past a shorter sequence's length, or
before a window), whose slots hold whatever the block's last owner left. A mask does not make
them harmless: SDPA's masked score of a NaN key is NaN, and a 0 probability times a NaN value
is NaN. A NaN there (another request's overflowed adapter) would end every row that pads past
it. So each group lists those keys (``_Group.stale``) and the gathered K and V are zeroed there,
a write per stale key, not a pass over the gather.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from loraplex.kernels.kv_quant import as_bytes, is_fp8, quantize_kv
from loraplex.kernels.padding import padded_groups

# A prefill group's padded work (chunks x longest query x longest key run) may exceed its real
# work by this factor; a chunk that would push past it starts a new group, so one long prompt
# never pads a batch of short ones.
MAX_PADDING_FACTOR = 1.5


@dataclass
class _Group:
    """Sequences attended in one padded call."""

    blocks: torch.Tensor  # [P * num_blocks] int64, the group's block tables, row-major
    num_blocks: int
    longest: int  # key positions kept (longest seq_len in the group)
    rows: torch.Tensor | None  # [P, Q] flat query row of each padded query; None = decode rows 0..S-1
    mask: torch.Tensor  # [P, 1, Q, L] bool, True = may attend
    valid: torch.Tensor | None  # [P, Q] bool, padded queries that are real rows; None = all
    q_pos: torch.Tensor  # [P, Q] absolute position of each padded query
    tables: torch.Tensor | None = None  # [P, max_blocks] int64, each sequence's whole block table
    # (rows, keys) gathered that no real query of their row may attend; None = there are none
    stale: tuple[torch.Tensor, torch.Tensor] | None = None
    windowed: dict[int, "_Group"] = field(default_factory=dict)  # window -> the group narrowed to it

    def for_window(self, window: int | None, block_size: int) -> "_Group":
        """This group, or with a window the one that reads only the blocks the windows reach."""
        if window is None:
            return self
        if window not in self.windowed:
            self.windowed[window] = _window_group(self, window, block_size)
        return self.windowed[window]


def _window_group(group: _Group, window: int, block_size: int) -> _Group:
    """``group`` reading, per sequence, the blocks from the one holding its first query's first
    key (position ``q_pos - window + 1``) to its last query's, with the windowed causal mask."""
    first_q = group.q_pos[:, 0]  # [P] the chunk's first position (a decode: its only one)
    last_q = group.q_pos if group.valid is None else group.q_pos.masked_fill(~group.valid, -1)
    last_q = last_q.amax(1)  # [P] its last real query
    first = (first_q + 1 - window).clamp_min(0) // block_size  # [P] first block with a key in the window
    if not bool(first.any()):  # every window starts in block 0: only the mask narrows
        mask = group.mask & _inside(group, window)
        return _Group(group.blocks, group.num_blocks, group.longest, group.rows, mask, group.valid, group.q_pos,
                      stale=_stale_keys(mask, group.valid))
    num_blocks = int((last_q // block_size - first).max()) + 1
    length = num_blocks * block_size
    k_pos = first.unsqueeze(1) * block_size + torch.arange(length)  # [P, L] position of each key read
    diff = group.q_pos.unsqueeze(2) - k_pos.unsqueeze(1)  # [P, Q, L] query position - key position
    mask = ((diff >= 0) & (diff < window)).unsqueeze(1)  # [P, 1, Q, L]
    # a sequence whose keys end before num_blocks reads table entries past its own (padding, or
    # the last column again), masked as in _blocks
    index = (first.unsqueeze(1) + torch.arange(num_blocks)).clamp_max(group.tables.shape[1] - 1)  # [P, nb]
    return _Group(group.tables.gather(1, index).flatten(), num_blocks, length, group.rows, mask, group.valid,
                  group.q_pos, stale=_stale_keys(mask, group.valid))


def _stale_keys(mask: torch.Tensor, valid: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(row, key) index pairs of the keys that no real query of their row may attend ([P, 1, Q,
    L] ``mask``, [P, Q] ``valid``: padded queries attend what they like, and are dropped)."""
    attended = mask[:, 0] if valid is None else mask[:, 0] & valid.unsqueeze(2)  # [P, Q, L]
    stale = ~attended.any(dim=1)  # [P, L]
    if not bool(stale.any()):
        return None
    return tuple(stale.nonzero(as_tuple=True))


def _inside(group: _Group, window: int) -> torch.Tensor:  # [P, 1, Q, L] keys at positions > q_pos - window
    k_pos = torch.arange(group.longest).view(1, 1, -1)
    return (k_pos > (group.q_pos - window).unsqueeze(2)).unsqueeze(1)


@dataclass
class AttentionPlan:
    """One step's attention work, computed from the metadata alone (no K/V, no queries)."""

    decode: _Group | None
    prefill: list[_Group]
    block_size: int = 16

    def decode_for(self, sliding_window: int | None) -> _Group | None:
        """The decode rows' group; with a window, one that gathers only the window's blocks."""
        return None if self.decode is None else self.decode.for_window(sliding_window, self.block_size)


def plan_paged_attention(
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    block_size: int,
) -> AttentionPlan:
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
    decode = [i for i, q in enumerate(q_lens) if q == 1]
    chunks = [(i, q, lens[i]) for i, q in enumerate(q_lens) if q > 1]
    return AttentionPlan(
        decode=_decode_group(block_tables, decode, starts, lens, block_size) if decode else None,
        prefill=[_prefill_group(block_tables, g, starts, block_size) for g in _prefill_groups(chunks)],
        block_size=block_size,
    )


def _blocks(block_tables: torch.Tensor, seqs: list[int] | None, longest: int, block_size: int):
    num_blocks = (longest + block_size - 1) // block_size
    tables = block_tables if seqs is None else block_tables[seqs]
    return tables[:, :num_blocks].long().flatten(), num_blocks


def _decode_group(block_tables, decode, starts, lens, block_size) -> _Group:
    pure = len(decode) == starts[-1]  # every row of the batch is a decode, in order
    dec_lens = torch.tensor([lens[i] for i in decode])
    longest = int(dec_lens.max())
    blocks, num_blocks = _blocks(block_tables, None if pure else decode, longest, block_size)
    keep = torch.arange(longest).unsqueeze(0) < dec_lens.unsqueeze(1)  # [S, L]
    rows = None if pure else torch.tensor([[starts[i]] for i in decode])
    mask = keep.view(len(decode), 1, 1, longest)
    tables = (block_tables if pure else block_tables[decode]).long()
    return _Group(blocks, num_blocks, longest, rows, mask, None, (dec_lens - 1).unsqueeze(1), tables,
                  _stale_keys(mask, None))


def _prefill_groups(chunks: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    """Split ``(seq index, q_len, seq_len)`` chunks into groups worth one padded call each."""
    return padded_groups(chunks, lambda c: (c[2], c[1]), MAX_PADDING_FACTOR)


def _prefill_group(block_tables, group, starts, block_size) -> _Group:
    q_lens = torch.tensor([q for _, q, _ in group])  # [P]
    seq_lens = torch.tensor([n for _, _, n in group])
    longest_q, longest = int(q_lens.max()), int(seq_lens.max())
    blocks, num_blocks = _blocks(block_tables, [i for i, _, _ in group], longest, block_size)
    # padded query j of chunk p reads flat row start_p + min(j, q_len_p - 1); padding rows are
    # computed (they see a valid key range) and never written back
    j = torch.arange(longest_q).unsqueeze(0)  # [1, Q]
    first = torch.tensor([starts[i] for i, _, _ in group]).unsqueeze(1)  # [P, 1]
    rows = first + torch.minimum(j, q_lens.unsqueeze(1) - 1)  # [P, Q]
    # query j of chunk p sits at position seq_len_p - q_len_p + j and sees keys up to it
    q_pos = (seq_lens - q_lens).unsqueeze(1) + j  # [P, Q]
    allowed = torch.arange(longest).view(1, 1, -1) <= q_pos.unsqueeze(2)  # [P, Q, L]
    valid = j < q_lens.unsqueeze(1)
    valid = None if bool(valid.all()) else valid
    tables = block_tables[[i for i, _, _ in group]].long()
    mask = allowed.unsqueeze(1)
    return _Group(blocks, num_blocks, longest, rows, mask, valid, q_pos, tables, _stale_keys(mask, valid))


def write_kv_cache_cpu(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64; slot < 0 = skip (padding)
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``index_copy_`` into the cache seen as one row per slot (no boolean-mask indexing). An
    fp8 cache takes the quantized K/V (``kv_quant.quantize_kv``, ``x / scale``) as bytes: torch
    has no CPU ``index_copy_`` for fp8."""
    if key.shape[0] == 0:
        return
    if int(slot_mapping.min()) < 0:
        valid = slot_mapping >= 0
        key, value, slot_mapping = key[valid], value[valid], slot_mapping[valid]
    rows = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, num_blocks * block_size, kvh, d]
    key, value = quantize_kv(key, kv_cache.dtype, k_scale), quantize_kv(value, kv_cache.dtype, v_scale)
    if is_fp8(kv_cache.dtype):
        rows, key, value = as_bytes(rows), as_bytes(key), as_bytes(value)
    rows[0].index_copy_(0, slot_mapping, key)
    rows[1].index_copy_(0, slot_mapping, value)


def _gather_kv(kv_cache: torch.Tensor, group: _Group, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of a group's sequences in the compute ``dtype`` as stored (an fp8 cache upcast by
    the cast; its scales are applied by the caller), ``[P, kvh, L, d]`` each (transposed views of
    the gather)."""
    shape = (-1, group.num_blocks * kv_cache.shape[2], *kv_cache.shape[3:])
    # index_select on dim 0 copies whole blocks (memcpy); advanced indexing is ~5x slower here
    k, v = (torch.index_select(kv_cache[i], 0, group.blocks).view(shape)[:, : group.longest].to(dtype)
            for i in (0, 1))  # [P, L, kvh, d], fresh copies: ours to write
    if group.stale is not None:  # whatever a block's last owner left there must not reach a row
        k[group.stale] = 0
        v[group.stale] = 0
    return k.transpose(1, 2), v.transpose(1, 2)


def _softcapped_attention(
    q: torch.Tensor,  # [P, H, Q, d]
    k: torch.Tensor,  # [P, kvh, L, d]
    v: torch.Tensor,  # [P, kvh, L, d]
    mask: torch.Tensor,  # [P, 1, Q, L] bool
    scale: float,
    softcap: float,
) -> torch.Tensor:  # [P, H, Q, d]
    """Attention with ``tanh(scores / softcap) * softcap`` before the mask. As transformers'
    eager Gemma 2: products in the model dtype, cap and softmax in fp32, probabilities rounded to
    the model dtype for the product with V. The query heads that share a KV head are rows of one
    matmul (no repeated or broadcast K/V)."""
    p, h, q_len, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    group = h // kvh
    rows = q.reshape(p, kvh, group * q_len, d)  # head kvh_i * group + j, query t -> row j * Q + t
    scores = torch.matmul(rows, k.transpose(-1, -2)).float()  # [P, kvh, group * Q, L]
    scores = scores.mul_(scale).div_(softcap).tanh_().mul_(softcap)
    scores = scores.view(p, kvh, group, q_len, length).masked_fill_(~mask.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(p, kvh, group * q_len, length)
    return torch.matmul(probs, v).view(p, h, q_len, d)  # [P, kvh, group * Q, d] -> [P, H, Q, d]


def _attend_prefill(query, kv_cache, group: _Group, scale: float, out: torch.Tensor, softcap) -> None:
    """One group of prompt chunks as one ``scaled_dot_product_attention`` over padded queries
    and K/V (GQA without repeating K/V)."""
    k, v = _gather_kv(kv_cache, group, query.dtype)
    q = query[group.rows]  # [P, Q, H, d]
    mask = group.mask
    if softcap is not None:
        attn = _softcapped_attention(q.transpose(1, 2), k, v, mask, scale, softcap).transpose(1, 2)
    else:
        attn = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != query.shape[1]
        ).transpose(1, 2)  # [P, Q, H, d]
    if group.valid is None:
        out[group.rows.flatten()] = attn.flatten(0, 1)
    else:
        out[group.rows[group.valid]] = attn[group.valid]


def _attend_decode(query, kv_cache, group: _Group, scale: float, out: torch.Tensor, softcap) -> None:
    """Decode rows, GQA without ``enable_gqa``: the query heads that share a KV head become that
    head's query rows (``[S, kvh, heads per kv head, d]``), one plain SDPA over them. About 20%
    faster than ``enable_gqa`` on one query row, and steadier."""
    k, v = _gather_kv(kv_cache, group, query.dtype)  # [S, kvh, L, d]
    q = query if group.rows is None else query[group.rows.flatten()]  # [S, H, d]
    mask = group.mask  # [S, 1, 1, L]
    if softcap is not None:
        attn = _softcapped_attention(q.unsqueeze(2), k, v, mask, scale, softcap).reshape(q.shape)
    else:
        grouped = q.reshape(q.shape[0], k.shape[1], -1, k.shape[3])  # [S, kvh, heads per kv head, d]
        attn = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale).reshape(q.shape)
    if group.rows is None:
        out.copy_(attn)
    else:
        out[group.rows.flatten()] = attn


def paged_attention_cpu(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    max_query_len: int = 0,
    max_seq_len: int = 0,
    plan: AttentionPlan | None = None,  # from plan_paged_attention on the same metadata
    sliding_window: int | None = None,  # keys at positions > q_pos - window only
    softcap: float | None = None,  # scores -> tanh(scores / softcap) * softcap
    k_scale: float = 1.0,  # the layer's KV-cache scales: K and V are read as stored * scale
    v_scale: float = 1.0,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if plan is None:
        plan = plan_paged_attention(block_tables, seq_lens, query_start_loc, kv_cache.shape[2])
    out = torch.empty_like(query)
    # q . (k * k_scale) = (q . k) * k_scale, and softmax(s) @ (v * v_scale) = (softmax(s) @ v) * v_scale
    scale = scale * k_scale
    if plan.decode is not None:
        _attend_decode(query, kv_cache, plan.decode_for(sliding_window), scale, out, softcap)
    for group in plan.prefill:
        _attend_prefill(query, kv_cache, group.for_window(sliding_window, plan.block_size), scale, out, softcap)
    return out if v_scale == 1.0 else out.mul_(v_scale)
