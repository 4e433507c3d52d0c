"""Helpers shared by the model tests: run whole sequences through loraplex's decoder."""

from __future__ import annotations

import torch

from loraplex.model.layers import AttentionMetadata


def assert_sampled_logprobs(hf_model, prompt: list[int], out, top_n: int, ordered: bool = False) -> None:
    """Each generated token's logprob and top-``top_n`` entries (``out`` is a CompletionOutput
    or RequestOutput of greedy decoding) against the log-softmax of ``hf_model``'s logits over
    prompt + output; ``ordered``: the top entries also come best first."""
    import pytest

    token_ids = out.token_ids
    entries = out.outputs[0].logprobs if hasattr(out, "outputs") else out.logprobs
    assert len(entries) == len(token_ids)
    with torch.no_grad():
        logp = hf_model(torch.tensor([prompt + token_ids])).logits[0].log_softmax(-1)
    for i, (token, entry) in enumerate(zip(token_ids, entries)):
        row = logp[len(prompt) - 1 + i]
        assert entry["token_id"] == token
        assert entry["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        top = row.topk(top_n)
        assert set(entry["top_logprobs"]) == set(top.indices.tolist())
        if ordered:
            assert list(entry["top_logprobs"]) == top.indices.tolist()
        for tid, lp in entry["top_logprobs"].items():
            assert lp == pytest.approx(row[tid].item(), abs=1e-4)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def new_kv_caches(spec, num_blocks: int, block_size: int, dtype=torch.float32) -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim)
    return [torch.zeros(shape, dtype=dtype) for _ in range(spec.num_layers)]


def chunk_metadata(
    chunks: list[tuple[int, int, list[int]]], block_size: int
) -> tuple[torch.Tensor, AttentionMetadata]:
    """``(positions, metadata)`` for chunks ``(start_pos, num_tokens, block_table)`` of sequences."""
    positions, slots, seq_lens, qsl, tables = [], [], [], [0], []
    for start, n, table in chunks:
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(start + n)
        qsl.append(qsl[-1] + n)
        tables.append(table)
    width = max(len(t) for t in tables)
    attn = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        max_query_len=max(n for _, n, _ in chunks),
        max_seq_len=max(seq_lens),
    )
    return torch.tensor(positions, dtype=torch.int64), attn
