"""CUDA-graph decode steps (``loraplex.engine.cuda_graphs``), checked on CPU.

The Triton kernels run under the interpreter (dispatch forced to them) and a stand-in capture
replays the forward eagerly on the same static buffers, so what a graph depends on is all
exercised: padding to a bucket (slot -1 rows, query-less sequences, base-model rows), the static
attention metadata with ``max_model_len`` as the length bound (split-KV included), the static
LoRA segments with empty spares and a fixed segment class, every projection run. Greedy outputs
must equal PEFT's (an independent reference). What CPU cannot check is the capture itself: the
replayed forward must read nothing back to the host and build no tensor from host data (both
trapped here); ``kernels/gpu_check.py`` runs real graphs on a GPU.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for
from tests.kernels.test_no_host_sync import trap_host_reads
from tests.lora.test_acceptance import reference

from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture  # noqa: E402
from loraplex.kernels import dispatch  # noqa: E402
from loraplex.sampling_params import SamplingParams  # noqa: E402

ADAPTERS = {
    "qv_r2": dict(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    "mlp_r8": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "all_r16": dict(r=16, lora_alpha=8, target_modules="all-linear"),
}


@pytest.fixture(scope="module")
def graph_setup(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from loraplex.engine.llm import LLM

    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("graph-adapters")
    dirs = {n: make_peft_adapter(base, root / n, seed=40 + i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    llm = LLM(
        model=str(tiny_llama_dir), dtype="float32", device="cpu", kv_cache_bytes=4 << 20,
        max_loras=4, max_lora_rank=16, max_num_seqs=8, max_model_len=600,
    )
    for name, path in dirs.items():
        llm.add_adapter(name, str(path))
    runner = llm.engine.runner
    runner.decode_graphs = DecodeGraphs(
        runner.model, runner.kv_caches, runner.block_size, runner.max_model_len, 8, capture=eager_capture
    )
    return llm, peft_model_for(base, dirs)


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)


def test_buckets():
    graphs = DecodeGraphs.__new__(DecodeGraphs)
    graphs.buckets = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert [graphs.bucket_for(n) for n in (1, 3, 8, 9, 25, 200, 256)] == [1, 4, 8, 16, 32, 224, 256]


@pytest.mark.slow
def test_graph_decode_steps_match_peft(graph_setup, triton_on_cpu):
    llm, peft_model = graph_setup
    graphs = llm.engine.runner.decode_graphs
    rng = random.Random(5)
    choices = [None, *ADAPTERS]
    # 7 sequences (bucket 8, one padding row); different lengths shrink the batch through
    # buckets 8, 4, 2, 1; an adapter with two sequences makes a segment of 2
    which = [choices[i % len(choices)] for i in range(6)] + ["mlp_r8"]
    prompts = [[rng.randrange(4, 260) for _ in range(rng.randrange(3, 12))] for _ in which]
    lengths = [6, 2, 4, 3, 6, 1, 5]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate(prompts, params, adapters=which)
    mismatches = [
        (a, p, o.token_ids, reference(peft_model, p, a, n))
        for a, p, o, n in zip(which, prompts, outs, lengths)
        if o.token_ids != reference(peft_model, p, a, n)
    ]
    assert not mismatches, mismatches
    lora_keys = {key for key in graphs.graphs if key[1] > 0}
    assert {b for b, _ in lora_keys} >= {8, 4}, graphs.graphs.keys()
    assert max(c for _, c in lora_keys) == 2  # mlp_r8's two sequences
    assert sum(g.graph.replays for g in graphs.graphs.values()) >= 4
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
    # projections an adapter leaves alone have rank 0 in their stack: the kernels read nothing there
    pool = llm.engine.lora_manager.pool
    qv = pool.slot_of(llm.engine.resolve_adapter("qv_r2"))
    assert [int(pool.stacks[0][m].rank[qv]) for m in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")] == [2, 0, 0, 0]

    # the base model alone: graphs without LoRA kernels; and a context long enough to split KV
    long_prompt = [rng.randrange(4, 260) for _ in range(520)]
    base_prompts = [long_prompt, prompts[0]]
    outs = llm.generate(base_prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert [o.token_ids for o in outs] == [reference(peft_model, p, None, 3) for p in base_prompts]
    assert (2, 0) in graphs.graphs


@pytest.mark.slow
def test_replayed_forward_reads_nothing_back_to_the_host(graph_setup, triton_on_cpu, monkeypatch):
    llm, _ = graph_setup
    graphs = llm.engine.runner.decode_graphs
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
                 adapters=["all_r16", None])
    assert graphs.graphs
    made = []
    real_tensor = torch.tensor
    monkeypatch.setattr(torch, "tensor", lambda *a, **k: made.append(a) or real_tensor(*a, **k))
    with trap_host_reads() as reads, torch.inference_mode():  # as ModelRunner.execute runs it
        for graph in graphs.graphs.values():
            graph.graph.replay()
    assert reads == [] and made == []


def test_graph_metadata_sizes_launches_for_the_segments_a_full_bucket_holds(graph_setup, triton_on_cpu):
    """The static metadata lists min(batch, max_loras) segments (spares exit at once) but sizes
    the kernels' K splits and column runs for batch / segment class of them, as many as a full
    bucket of that class holds, so a graph step's real segments get an eager step's programs."""
    llm, _ = graph_setup
    graphs, pool = llm.engine.runner.decode_graphs, llm.engine.lora_manager.pool
    for batch, seg_class, expected in ((8, 2, 4), (8, 1, 8), (8, 8, 1), (4, 4, 1)):
        meta = graphs._lora_context(batch, seg_class, pool).meta
        assert meta.num_segments == min(batch, pool.max_loras)
        assert meta.sizing_segments == expected


# the K split forced on the tiny model (64 / 128 wide): 16-wide K blocks and a large program target
_SPLITTING = dict(shrink_tile_elements=256, shrink_programs=1 << 16)


@pytest.mark.slow
@pytest.mark.parametrize("shrink, expand, split_sum, extra", [
    ("dot", "rows_ahead", "launch", {}), ("acc", "dot", "launch", {}), ("rows_x_rank", "rows_ahead", "expand", _SPLITTING),
    ("rows_x_rank", "dot", "expand", _SPLITTING),
])
def test_graph_decodes_run_any_variant_a_tuning_installs(graph_setup, triton_on_cpu, monkeypatch, shrink, expand,
                                                         split_sum, extra):
    """``gpu_check.py --tune-lora`` installs its choice as ``triton_lora.DEFAULT_TUNING`` before the
    end-to-end engine runs: whichever decode variants it names, and wherever it has the K splits'
    partials added, the graph steps (static padded metadata, spare segments) must still give
    PEFT's greedy tokens, and run them."""
    from loraplex.kernels import triton_lora

    classes = len(triton_lora.DECODE_SEG_CLASSES)
    tuning = triton_lora.GemvTuning(shrink_gemv=(shrink,) * classes, expand_gemv=(expand,) * classes,
                                    split_sum=split_sum, **extra)
    monkeypatch.setattr(triton_lora, "DEFAULT_TUNING", tuning)
    read_partials = []  # per expand launch: did it add the split partials itself
    real_expand = triton_lora.lora_expand_triton
    monkeypatch.setattr(triton_lora, "lora_expand_triton",
                        lambda shrunk, *a, **k: read_partials.append(shrunk.dim() == 4) or real_expand(shrunk, *a, **k))
    chosen = []
    real_shrink_tiles, real_expand_tiles = triton_lora.shrink_tiles, triton_lora.expand_tiles
    monkeypatch.setattr(triton_lora, "shrink_tiles", lambda *a, **k: chosen.append(a[2]) or real_shrink_tiles(*a, **k))
    monkeypatch.setattr(triton_lora, "expand_tiles", lambda *a, **k: chosen.append(a[2]) or real_expand_tiles(*a, **k))
    llm, peft_model = graph_setup
    graphs = llm.engine.runner.decode_graphs
    replays = sum(g.graph.replays for key, g in graphs.graphs.items() if key[1] > 0)
    rng = random.Random(17 + len(shrink))
    which = ["all_r16", "mlp_r8", None, "mlp_r8", "qv_r2"]  # segments of 1 and 2 rows
    prompts = [[rng.randrange(4, 260) for _ in range(rng.randrange(3, 9))] for _ in which]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True), adapters=which)
    assert [o.token_ids for o in outs] == [reference(peft_model, p, a, 3) for p, a in zip(prompts, which)]
    assert sum(g.graph.replays for key, g in graphs.graphs.items() if key[1] > 0) > replays
    assert {shrink, expand} <= set(chosen)
    assert any(read_partials) == (split_sum == "expand")


def test_graph_lora_metadata_is_rewritten_only_when_the_segments_change():
    """A steady decode batch (the same slots in the same order, the same bucket) reuses the
    static LoRA metadata its last step wrote; any other step writes exactly its own segments.
    Checked against ``group_by_slot`` of each step's slots, padded as the module doc says."""
    from types import SimpleNamespace

    from loraplex.lora.context import group_by_slot

    graphs = DecodeGraphs(torch.nn.Identity(), [torch.zeros(2, 4, 16, 1, 8)], 16, 64, 8, capture=eager_capture)
    pool = SimpleNamespace(max_loras=3)
    puts = []
    real_put = graphs._staging.put
    graphs._staging.put = lambda buffer, *a, **k: puts.append(buffer) or real_put(buffer, *a, **k)

    def expected(slots: list[int], batch: int):
        perm, starts, seg_slot, _ = group_by_slot(slots + [-1] * (batch - len(slots)))
        n = min(batch, pool.max_loras)
        return perm, starts + [batch] * (n + 1 - len(starts)), seg_slot + [0] * (n - len(seg_slot))

    rng = random.Random(3)
    history = [([2, -1, 2, 0], 4), ([2, -1, 2, 0], 4), ([0, 2, 2, -1], 4), ([2, -1, 2, 0], 4), ([2, -1, 2, 0], 8),
               ([2, -1, 2, 0], 8), ([1], 1), ([1], 1)]
    history += [([rng.choice([-1, 0, 1, 2]) for _ in range(n)], graphs.bucket_for(n))
                for n in (rng.randint(1, 8) for _ in range(30))]
    last = None
    for slots, batch in history:
        puts.clear()
        seg_class = graphs._fill_lora(list(slots), batch, pool)
        perm, starts, seg_slot = expected(slots, batch)
        n = min(batch, pool.max_loras)
        assert graphs.token_perm[:batch].tolist() == perm
        assert graphs.seg_starts[: n + 1].tolist() == starts and graphs.seg_slot[:n].tolist() == seg_slot
        longest = max((b - a for a, b in zip(starts, starts[1:])), default=0)
        assert seg_class == min(batch, 1 << (max(1, longest) - 1).bit_length())
        assert (puts == []) == (last == (slots, batch))  # nothing written for the same step again
        last = (slots, batch)
