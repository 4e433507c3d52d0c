"""``ModelRunner.prepare_batch`` (the one-token fast path through ``decode_inputs`` and the
host copy of the block tables, and the general path) against a step's inputs written out one
token at a time from the sequences' own lists, on every step of real engines under churn:
Gemma-2-like (a windowed and a global layer group, whose windowed tables give pages back) and
Llama (one group), blocks of 16 and 32 tokens, a KV pool small enough to preempt and resume,
shared prefixes (prefix-cache hits), n-gram speculative steps (drafts whose rejected blocks are
popped) and requests arriving while others decode. The CUDA-graph path reads the same
``decode_inputs`` (tests/kernels/test_decode_graphs.py runs it against PEFT)."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.engine.llm_engine import LLMEngine
from loraplex.sampling_params import SamplingParams
from tests.fixtures.tiny_models import make_tiny_model_dir

S, F = "sliding_attention", "full_attention"


def reference_inputs(scheduled, block_size: int, group_windows) -> dict:
    """The step's inputs, token by token from each sequence's token and table lists; None for
    a token the host does not have yet (a step scheduled ahead: the step before samples it)."""
    ids, positions, seq_lens, query_start, sample_rows = [], [], [], [0], []
    slots = [[] for _ in group_windows]
    widths = [-(-(item.start_pos + item.num_tokens) // block_size) for item in scheduled]
    tables = [[] for _ in group_windows]
    for item in scheduled:
        start, end = item.start_pos, item.start_pos + item.num_tokens
        known = end - len(item.draft_token_ids)
        ids += item.seq.all_token_ids[start:known] + list(item.draft_token_ids)
        if start >= item.seq.num_tokens:
            ids.append(None)
        for pos in range(start, end):
            positions.append(pos)
            for g, table in enumerate(item.block_tables):
                slots[g].append(table[pos // block_size] * block_size + pos % block_size)
        seq_lens.append(end)
        query_start.append(query_start[-1] + item.num_tokens)
        if item.draft_token_ids:
            sample_rows += range(query_start[-1] - 1 - len(item.draft_token_ids), query_start[-1])
        elif item.needs_sample:
            sample_rows.append(query_start[-1] - 1)
        length = -(-end // block_size)
        for g, (window, table) in enumerate(zip(group_windows, item.block_tables)):
            first = 0 if window is None else max(0, start - window + 1) // block_size
            row = [-1 if i < first else table[i] for i in range(length)]
            tables[g].append(row + [0] * (max(widths) - length))
    return {"input_ids": ids, "positions": positions, "slots": slots, "tables": tables, "seq_lens": seq_lens,
            "query_start": query_start, "sample_rows": sample_rows}


def check_batch(batch, want: dict, num_groups: int) -> None:
    attn = batch.attn
    assert batch.input_ids.dtype == torch.int64 and len(batch.input_ids) == len(want["input_ids"])
    assert [t for t, w in zip(batch.input_ids.tolist(), want["input_ids"]) if w is not None] == [
        w for w in want["input_ids"] if w is not None]
    assert batch.positions.dtype == torch.int64 and batch.positions.tolist() == want["positions"]
    slot_mappings = attn.group_slot_mappings if num_groups > 1 else [attn.slot_mapping]
    block_tables = attn.group_block_tables if num_groups > 1 else [attn.block_tables]
    assert [s.dtype for s in slot_mappings] == [torch.int64] * num_groups
    assert [s.tolist() for s in slot_mappings] == want["slots"]
    assert [t.dtype for t in block_tables] == [torch.int32] * num_groups
    assert [t.tolist() for t in block_tables] == want["tables"]
    assert attn.seq_lens.dtype == torch.int32 and attn.seq_lens.tolist() == want["seq_lens"]
    assert attn.query_start_loc.dtype == torch.int32 and attn.query_start_loc.tolist() == want["query_start"]
    assert attn.max_seq_len == max(want["seq_lens"]) and isinstance(attn.max_seq_len, int)
    assert attn.max_query_len == max(b - a for a, b in zip(want["query_start"], want["query_start"][1:]))
    assert batch.sample_rows == want["sample_rows"]
    if num_groups > 1:
        assert attn.slot_mapping is slot_mappings[0] and attn.block_tables is block_tables[0]


@pytest.mark.parametrize("kind, block_size, speculative, ahead", [
    ("gemma2", 16, False, False), ("gemma2", 32, False, False), ("llama", 16, False, False),
    ("llama", 32, False, False), ("gemma2", 16, True, False), ("llama", 32, True, False),
    ("gemma2", 16, False, True), ("llama", 32, False, True),
])
def test_prepare_batch_matches_token_by_token_inputs(kind, block_size, speculative, ahead, tmp_path):
    rng = random.Random(block_size * 7 + len(kind))
    extra = {"sliding_window": 24, "layer_types": [S, F, S, F]} if kind == "gemma2" else {}
    model_dir = make_tiny_model_dir(tmp_path / kind, kind, seed=3, num_hidden_layers=4, **extra)
    options = dict(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home",
                   block_size=block_size, max_num_seqs=12, max_num_batched_tokens=96, max_model_len=256)
    if speculative:
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                                         "prompt_lookup_min": 2}
    probe = LLMEngine(EngineConfig(**options, kv_cache_bytes=1 << 24))
    page_bytes = probe.runner.kv_bytes_per_page
    del probe
    # room for about three 150-token sequences in every group: twelve running ones preempt
    engine = LLMEngine(EngineConfig(**options, kv_cache_bytes=page_bytes * (3 * 2 * 160 // block_size),
                                    schedule_ahead=ahead))
    runner = engine.runner
    layout = runner.kv_layout
    assert layout.num_groups == (2 if kind == "gemma2" else 1)
    seen = {"one_token": 0, "general": 0, "drafts": 0}
    real_prepare = runner.prepare_batch

    launched_ahead = []  # (input ids, (sequence, position) per row) of the steps scheduled ahead

    def checked(scheduled, after=None):
        batch = real_prepare(scheduled, after)
        want = reference_inputs(scheduled, block_size, layout.group_windows)
        check_batch(batch, want, layout.num_groups)
        assert after is not None or None not in want["input_ids"]
        if after is not None:  # the tokens still being sampled are checked once they are known, below
            rows = [(item.seq, pos) for item in scheduled for pos in range(item.start_pos, item.start_pos + item.num_tokens)]
            launched_ahead.append((batch.input_ids.tolist(), rows))
        one_token = all(item.num_tokens == 1 for item in scheduled)
        seen["one_token" if one_token else "general"] += 1
        seen["drafts"] += any(item.draft_token_ids for item in scheduled)
        return batch

    runner.prepare_batch = checked
    shared = [rng.randrange(4, 200) for _ in range(40)]  # a prefix of whole blocks, cached once computed
    motif = [rng.randrange(4, 200) for _ in range(6)]  # repeated: the n-gram proposer drafts from it
    to_add = 30
    while to_add or engine.has_unfinished():
        if to_add and (rng.random() < 0.3 or not engine.has_unfinished()):
            to_add -= 1
            prompt = (shared if rng.random() < 0.5 else []) + motif * rng.randint(1, 4)
            prompt += [rng.randrange(4, 200) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(temperature=0.0, max_tokens=rng.randint(5, 90), ignore_eos=True,
                                    n=rng.choice([1, 1, 2]))
            engine.add_request(None, prompt, params)
        engine.step()
    stats = engine.stats()
    # each step launched ahead took, as its input, the token its sequence then got there; some
    # admitted prompts beside the decodes (the general path) and some were decodes alone
    assert len(launched_ahead) > 20 if ahead else not launched_ahead
    if ahead:
        assert any(len(rows) > len({seq.seq_id for seq, _ in rows}) for _, rows in launched_ahead)
    for ids, rows in launched_ahead:
        assert ids == [seq.all_token_ids[pos] for seq, pos in rows]
    assert seen["general"] > 5 and (seen["drafts"] > 0 if speculative else seen["one_token"] > 20), seen
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0, stats
    engine.step()  # hands the runner the last finished sequences' ids
    # every finished or preempted sequence's row went back: none held once nothing runs
    assert runner.table_mirror.num_rows_held == 0
