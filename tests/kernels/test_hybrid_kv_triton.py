"""Layer groups on the Triton kernels (interpreter, CPU tensors): a global and a windowed group
take their pages from one pool and keep their layers' K/V in one storage tensor, the windowed
group's table holding literal ``FREED_BLOCK`` (-1) entries before its window, as the block manager
leaves them. The storage is a view one page into a NaN tensor, so a read through a -1 entry (or
of another group's page) turns the output NaN. Each group's writes and attention must equal the
reference over its own intact, contiguous cache. Then the whole engine with dispatch forced to
the Triton kernels and decode steps through CUDA-graph replays (eager) on hybrid Gemma 2 / 3,
token-identical to transformers."""

from __future__ import annotations

import pytest
import torch

from loraplex.engine.block_manager import FREED_BLOCK, BlockManager
from loraplex.engine.sequence import Sequence
from loraplex.kernels import dispatch
from loraplex.kernels.attention_ref import paged_attention_ref, write_kv_cache_ref
from loraplex.kernels.triton_attention import paged_attention_triton, write_kv_cache_triton
from loraplex.sampling_params import SamplingParams
from tests.kernels.helpers import rel_err
from tests.kernels.test_triton_attention import TOL

HEADS, KV_HEADS, HEAD_DIM, BLOCK, WINDOW = 4, 2, 16, 8, 13
SEQS = [(120, 1), (47, 9), (30, 1), (0, 21), (64, 17)]  # (computed prefix, query tokens)


def _group_tables(bm: BlockManager) -> list[Sequence]:
    seqs = []
    for i, (ctx, q) in enumerate(SEQS):
        seq = Sequence(seq_id=i, request_id=str(i), prompt_token_ids=list(range(ctx + q)), params=SamplingParams())
        bm.allocate(seq, ctx + q if ctx == 0 else ctx)
        if ctx:
            seq.num_computed_tokens = ctx
            bm.append(seq, q)  # gives back the windowed group's pages before the window
        seqs.append(seq)
    return seqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_groups_share_storage_and_skip_freed_entries(dtype):
    gen = torch.Generator().manual_seed(7 + (dtype == torch.float16))
    windows = (None, WINDOW)
    bm = BlockManager(200, BLOCK, group_windows=windows)
    seqs = _group_tables(bm)
    assert any(FREED_BLOCK in s.block_tables[1] for s in seqs)  # some windowed entries given back
    base = torch.full((2, bm.num_blocks + 1, BLOCK, KV_HEADS, HEAD_DIM), float("nan"), dtype=dtype)
    storage = base[:, 1:]  # page -1 of the storage is NaN memory
    seq_lens = torch.tensor([c + q for c, q in SEQS], dtype=torch.int32)
    query_start_loc = torch.tensor([0] + [q for _, q in SEQS], dtype=torch.int32).cumsum(0).to(torch.int32)
    num_tokens = int(query_start_loc[-1])
    for g, window in enumerate(windows):  # one layer of each group: its own K/V for every position
        k_all = [torch.randn(c + q, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for c, q in SEQS]
        v_all = [torch.randn(c + q, KV_HEADS, HEAD_DIM, generator=gen).to(dtype) for c, q in SEQS]
        # the prefix was written by earlier steps: only what the group still holds
        for s, (c, _), k, v in zip(seqs, SEQS, k_all, v_all):
            held = [p for p in range(c) if s.block_tables[g][p // BLOCK] != FREED_BLOCK]
            slots = torch.tensor([s.block_tables[g][p // BLOCK] * BLOCK + p % BLOCK for p in held], dtype=torch.int64)
            write_kv_cache_ref(k[held], v[held], storage, slots)
        # this step's tokens through the kernel, with the step's slot mapping
        slots = torch.tensor([s.block_tables[g][p // BLOCK] * BLOCK + p % BLOCK
                              for s, (c, q) in zip(seqs, SEQS) for p in range(c, c + q)], dtype=torch.int64)
        write_kv_cache_triton(torch.cat([k[c:] for k, (c, _) in zip(k_all, SEQS)]),
                              torch.cat([v[c:] for v, (c, _) in zip(v_all, SEQS)]), storage, slots)
        width = max(len(s.block_tables[g]) for s in seqs)
        tables = torch.tensor([s.block_tables[g] + [0] * (width - len(s.block_tables[g])) for s in seqs],
                              dtype=torch.int32)
        query = torch.randn(num_tokens, HEADS, HEAD_DIM, generator=gen).to(dtype)
        out = torch.full_like(query, float("nan"))
        paged_attention_triton(query, storage, tables, seq_lens, query_start_loc, HEAD_DIM ** -0.5,
                               max(q for _, q in SEQS), int(seq_lens.max()), out=out, sliding_window=window)
        # the reference: the group's whole K/V, contiguous, nothing freed
        ref_cache = torch.zeros(2, sum(-(-(c + q) // BLOCK) for c, q in SEQS), BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
        ref_tables, first = [], 0
        for (c, q), k, v in zip(SEQS, k_all, v_all):
            n = -(-(c + q) // BLOCK)
            ref_tables.append(list(range(first, first + n)) + [0] * (width + 8 - n))
            write_kv_cache_ref(k, v, ref_cache, torch.arange(first * BLOCK, first * BLOCK + c + q))
            first += n
        want = paged_attention_ref(query, ref_cache, torch.tensor(ref_tables, dtype=torch.int32), seq_lens,
                                   query_start_loc, HEAD_DIM ** -0.5, max(q for _, q in SEQS),
                                   int(seq_lens.max()), sliding_window=window)
        assert not out.isnan().any(), f"group {g}: a freed entry or a foreign page was read"
        assert rel_err(out, want) < TOL[dtype]


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_engine_on_triton_kernels_with_graph_decodes_matches_transformers(kind, triton_on_cpu, tmp_path):
    from transformers import AutoModelForCausalLM

    from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture
    from loraplex.engine.llm import LLM
    from tests.engine.test_hybrid_kv_exact import LAYER_TYPES
    from tests.fixtures.tiny_models import make_tiny_model_dir
    from tests.lora.test_acceptance import greedy

    layers = LAYER_TYPES[kind]
    model_dir = make_tiny_model_dir(tmp_path / kind, kind, seed=4, sliding_window=WINDOW,
                                    num_hidden_layers=len(layers), layer_types=layers)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (33, 6)]
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", block_size=4,
              kv_cache_bytes=1 << 20, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=12)
    runner = llm.engine.runner
    assert runner.kv_layout.is_hybrid
    runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len, 2,
                                        eager_capture, layout=runner.kv_layout)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy(ref, p, 6) for p in prompts]
    assert sum(g.graph.replays for g in runner.decode_graphs.graphs.values()) >= 4  # the decodes ran as graphs
    assert llm.engine.stats()["num_blocks_free"] == llm.engine.stats()["num_blocks_total"]


def test_graph_decodes_over_shrinking_buckets_on_qwen2_sliding_layers(triton_on_cpu, tmp_path):
    """Qwen2 with ``use_sliding_window`` on its last two layers: five sequences of different
    lengths (some inside the window, some past it) finish one after another, so decode graphs
    of buckets 5, 4, 2 and 1 replay over static tables whose rows still hold an earlier, larger
    batch's entries; prefix caching on. Tokens equal transformers'."""
    from transformers import AutoModelForCausalLM

    from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture
    from loraplex.engine.llm import LLM
    from tests.fixtures.tiny_models import make_tiny_model_dir
    from tests.lora.test_acceptance import greedy

    model_dir = make_tiny_model_dir(tmp_path / "qwen2", "qwen2", seed=3, num_hidden_layers=3,
                                    use_sliding_window=True, sliding_window=5, max_window_layers=1)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (2, 14, 3, 9, 21)]
    max_tokens = [3, 9, 5, 7, 4]
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", block_size=2,
              kv_cache_bytes=1 << 20, max_num_seqs=5, max_model_len=40, max_num_batched_tokens=64,
              enable_prefix_caching=True)
    runner = llm.engine.runner
    assert runner.kv_layout.group_windows == (None, 5, 5)
    runner.decode_graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len, 5,
                                        eager_capture, layout=runner.kv_layout)
    outs = llm.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens])
    assert [o.token_ids for o in outs] == [greedy(ref, p, m) for p, m in zip(prompts, max_tokens)]
    assert {batch for batch, _ in runner.decode_graphs.graphs} >= {5, 4, 2, 1}
    assert llm.engine.stats()["num_blocks_free"] == llm.engine.stats()["num_blocks_total"]
