"""LoRA on embed_tokens and lm_head on the Triton path (interpreter, CPU tensors, float16 and
float32): the embedding gather + SGMV expand and the lm_head SGMV shrink/expand of a slot pool
holding PEFT adapters with and without those targets, on a batch that mixes them with base rows,
equal a torch reference computed from the adapters' own PEFT tensors; the same with a CUDA
graph's static, padded metadata; and (slow) greedy decoding through graph-replayed decode
steps equals PEFT's."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import dispatch
from loraplex.kernels.lora_meta import LoRABatchMeta
from loraplex.lora.context import LoRAStepContext, build_batch_meta, group_by_slot, logits_lora
from loraplex.lora.peft_format import load_adapter_files, validate_adapter
from loraplex.lora.slots import SlotPool
from loraplex.lora.weights import AdapterWeights
from tests.fixtures.peft_adapters import make_peft_adapter, spec_for, tiny_llama
from tests.kernels.graph_decode import check_graph_decodes_match_peft

EMBED_A = "base_model.model.model.embed_tokens.lora_embedding_A"
EMBED_B = "base_model.model.model.embed_tokens.lora_embedding_B"
HEAD_A = "base_model.model.lm_head.lora_A.weight"
HEAD_B = "base_model.model.lm_head.lora_B.weight"
# slot -> adapter: 0 both vocab targets, 1 none (q/v only), 2 lm_head only, 3 embed_tokens only
ADAPTERS = [
    dict(r=8, lora_alpha=5, target_modules=["embed_tokens", "lm_head", "q_proj"], rank_pattern={"lm_head": 3}),
    dict(r=4, target_modules=["q_proj", "v_proj"]),
    dict(r=6, lora_alpha=2, use_rslora=True, target_modules=["lm_head"]),
    dict(r=2, lora_alpha=7, target_modules=["embed_tokens"]),
]
TOKEN_SLOTS = [-1, 2, 0, 0, 3, -1, 1, 0, 2, 3, 3, -1]
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


@pytest.fixture
def triton_on_cpu(monkeypatch):
    monkeypatch.setattr(dispatch, "uses_triton", lambda t: True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-triton")
    base = tiny_llama(seed=2)
    spec = spec_for(base)
    out = []
    for i, kw in enumerate(ADAPTERS):
        parsed = load_adapter_files(make_peft_adapter(base, root / f"a{i}", seed=60 + i, **kw))
        out.append((parsed, validate_adapter(parsed, spec, max_lora_rank=8)))
    return spec, out


def _pool(spec, adapters, dtype) -> SlotPool:
    pool = SlotPool(spec, max_loras=4, max_rank=8, device=torch.device("cpu"), dtype=dtype)
    for slot, (parsed, info) in enumerate(adapters):
        pool.write(slot, AdapterWeights.build(parsed, info, spec, dtype))
    return pool


def _embedding_reference(spec, adapters, token_slots, ids, scale):  # [T, hidden] fp32 deltas
    out = []
    for slot, token in zip(token_slots, ids.tolist()):
        parsed, info = adapters[slot] if slot >= 0 else (None, None)
        if info is None or "embed_tokens" not in info.vocab_modules:
            out.append(torch.zeros(spec.hidden_size))
            continue
        a, b = parsed.tensors[EMBED_A].float(), parsed.tensors[EMBED_B].float()  # [r, vocab], [hidden, r]
        out.append(a[:, token] @ b.t() * info.vocab_modules["embed_tokens"].scaling * scale)
    return torch.stack(out)


def _head_reference(spec, adapters, row_slots, hidden):  # [N, vocab] fp32 deltas
    out = []
    for slot, h in zip(row_slots, hidden.float()):
        parsed, info = adapters[slot] if slot >= 0 else (None, None)
        if info is None or "lm_head" not in info.vocab_modules:
            out.append(torch.zeros(spec.vocab_size))
            continue
        a, b = parsed.tensors[HEAD_A].float(), parsed.tensors[HEAD_B].float()  # [r, hidden], [vocab, r]
        out.append((h @ a.t()) @ b.t() * info.vocab_modules["lm_head"].scaling)
    return torch.stack(out)


def _close(got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    err = (got.float() - want).abs().max() / want.abs().max()
    assert err < TOLERANCE[dtype], float(err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_embedding_and_head_deltas_on_triton_match_peft_tensors(adapters, triton_on_cpu, dtype):
    spec, ads = adapters
    pool = _pool(spec, ads, dtype)
    gen = torch.Generator().manual_seed(1)
    num_tokens = len(TOKEN_SLOTS)
    ids = torch.randint(0, spec.vocab_size, (num_tokens,), generator=gen)
    meta = build_batch_meta(TOKEN_SLOTS, pool.slot_rank, pool.slot_rank_host)
    ctx = LoRAStepContext(pool, meta, token_slots=TOKEN_SLOTS)

    base = torch.randn(num_tokens, spec.hidden_size, generator=gen).to(dtype)
    hidden = base.clone()
    ctx.apply_embedding(ids, hidden, scale=1.5)
    _close(hidden.float() - base.float(), _embedding_reference(spec, ads, TOKEN_SLOTS, ids, 1.5), dtype)

    rows = [1, 2, 5, 6, 7, 8, 10]  # sampled rows: lm_head adapters, a q/v-only one, base rows
    h = torch.randn(len(rows), spec.hidden_size, generator=gen).to(dtype)
    logits = torch.randn(len(rows), spec.vocab_size, generator=gen)
    before = logits.clone()
    ctx.logits_lora(rows).apply(h, logits)
    _close(logits - before, _head_reference(spec, ads, [TOKEN_SLOTS[r] for r in rows], h), dtype)
    # rows whose adapters leave lm_head alone are untouched, bit for bit
    for i, r in enumerate(rows):
        if TOKEN_SLOTS[r] in (-1, 1, 3):
            assert torch.equal(logits[i], before[i])
    assert logits_lora(pool, [-1, 1, 3]) is None  # nothing to do: no kernel runs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_embedding_delta_under_a_graphs_static_padded_metadata(adapters, triton_on_cpu, dtype):
    """As ``DecodeGraphs`` builds it: a bucket padded with base rows, spare empty segments,
    no host lists, every projection run (slots without embed_tokens have rank 0 there)."""
    spec, ads = adapters
    pool = _pool(spec, ads, dtype)
    slots = TOKEN_SLOTS[:7]  # 7 decodes in a bucket of 8
    batch = 8
    perm, seg_starts, seg_slot, max_seg_len = group_by_slot(slots + [-1])
    num_segments = min(batch, pool.max_loras)
    spare = num_segments - len(seg_slot)
    meta = LoRABatchMeta(
        token_perm=torch.tensor(perm), seg_starts=torch.tensor(seg_starts + [batch] * spare, dtype=torch.int32),
        seg_slot=torch.tensor(seg_slot + [0] * spare, dtype=torch.int32), slot_rank=pool.slot_rank,
        num_tokens=batch, num_segments=num_segments, max_seg_len=8, max_rank=pool.max_rank,
        seg_starts_host=[], seg_slot_host=[], slot_rank_host=[],
    )
    ctx = LoRAStepContext(pool, meta, shrunk=torch.empty(2, 3, batch, pool.max_rank), every_projection=True)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, spec.vocab_size, (batch,), generator=gen)
    base = torch.randn(batch, spec.hidden_size, generator=gen).to(dtype)
    hidden = base.clone()
    ctx.apply_embedding(ids, hidden)
    _close(hidden.float() - base.float(), _embedding_reference(spec, ads, slots + [-1], ids, 1.0), dtype)
    assert torch.equal(hidden[7], base[7])  # the padding row


def test_pool_allocates_vocab_stacks_only_for_targets_in_use(adapters):
    spec, ads = adapters
    pool = SlotPool(spec, max_loras=4, max_rank=8, device=torch.device("cpu"), dtype=torch.float32)
    pool.write(0, AdapterWeights.build(*ads[1], spec, torch.float32))  # q/v only
    layers_only = pool.nbytes
    assert pool.vocab.nbytes == 0 and pool.vocab.get("lm_head") is None
    pool.write(1, AdapterWeights.build(*ads[2], spec, torch.float32))  # lm_head only
    # lm_head: A [1, 4, 8, 64] + B [4, 96, 8] fp32, scaling [1, 4] fp32, rank [4] int32
    head_bytes = 4 * (4 * 8 * 64 + 4 * 96 * 8 + 4) + 4 * 4
    assert pool.vocab.nbytes == head_bytes and pool.nbytes == layers_only + head_bytes
    assert pool.vocab.get("embed_tokens") is None
    pool.clear(1)
    assert int(pool.vocab.get("lm_head").rank[1]) == 0


@pytest.mark.slow
def test_graph_decode_steps_with_vocab_lora_match_peft(triton_on_cpu, tmp_path):
    from transformers import AutoModelForCausalLM

    from tests.fixtures.tiny_models import make_tiny_model_dir

    model_dir = make_tiny_model_dir(tmp_path / "model", "llama", seed=3)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    both = make_peft_adapter(hf, tmp_path / "both", seed=71, r=8, lora_alpha=16,
                             target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj"])
    head = make_peft_adapter(hf, tmp_path / "head", seed=72, r=4, target_modules=["lm_head"])
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (12, 3, 9, 5)]
    check_graph_decodes_match_peft(model_dir, hf, {"both": both, "head": head}, prompts,
                                   ["both", None, "head", "both"], tmp_path / "home")


@pytest.mark.slow
def test_graphs_captured_before_the_embedding_stack_existed_are_not_replayed(triton_on_cpu, tmp_path):
    """Decodes with an lm_head-only adapter capture LoRA graphs without the embedding LoRA; once
    an adapter with embed_tokens is loaded a CUDA graph's replay would skip its delta, so they are
    dropped and recaptured, and the tokens stay PEFT's. (The eager stand-in reruns the Python
    forward on replay, so it would pick the new stack up anyway: recapture is what is checked.)"""
    from transformers import AutoModelForCausalLM

    from loraplex.engine.cuda_graphs import DecodeGraphs, eager_capture
    from loraplex.engine.llm import LLM
    from loraplex.sampling_params import SamplingParams
    from tests.fixtures.peft_adapters import peft_model_for
    from tests.fixtures.tiny_models import make_tiny_model_dir
    from tests.lora.test_acceptance import reference

    model_dir = make_tiny_model_dir(tmp_path / "model", "llama", seed=4)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    dirs = {
        "head": make_peft_adapter(hf, tmp_path / "head", seed=81, r=4, target_modules=["lm_head"]),
        "embed": make_peft_adapter(hf, tmp_path / "embed", seed=82, r=4, lora_alpha=32, target_modules=["embed_tokens"]),
    }
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "home", kv_cache_bytes=1 << 20,
              max_loras=2, max_lora_rank=8, max_num_seqs=4, max_model_len=128)
    runner = llm.engine.runner
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_model_len, 4, eager_capture)
    runner.decode_graphs = graphs
    peft_model = peft_model_for(hf, dirs)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [[7, 8, 9, 10, 11], [40, 3, 77]]
    for name in ("head", "embed"):
        outs = llm.generate(prompts, params, adapters=[str(dirs[name])] * 2)
        assert [o.outputs[0].token_ids for o in outs] == [reference(peft_model, p, name, 8) for p in prompts], name
        if name == "head":
            stale = {key: g for key, g in graphs.graphs.items() if key[1] > 0}
            assert stale  # LoRA graphs captured without the embedding stack
    assert all(graphs.graphs.get(key) is not g for key, g in stale.items())
