"""ModelRunner: loading, KV sizing, flat-batch building, the LoRA hook and greedy decoding,
checked against transformers."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.config import EngineConfig
from loraplex.engine.device_choice import resolve_dtype
from loraplex.engine.model_runner import ModelRunner
from loraplex.engine.outputs import SchedulerOutput, ScheduledSeq
from loraplex.engine.sequence import Sequence
from loraplex.sampling_params import SamplingParams

BLOCK = 16


def make_runner(model_dir, home, **overrides) -> ModelRunner:
    options = dict(model=str(model_dir), home=home, kv_cache_bytes=1 << 20, max_model_len=256, block_size=BLOCK)
    return ModelRunner(EngineConfig(**{**options, **overrides}))


class BlockPool:
    """Hands every sequence its own scattered blocks (a stand-in for the block manager)."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks))[::-1]

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        while len(seq.block_table) * BLOCK < num_tokens:
            seq.block_table.append(self.free.pop())


def run_greedy(runner: ModelRunner, prompts: list[list[int]], max_tokens: int, prefill_chunk: int = 7) -> list[list[int]]:
    """Drive the runner like a scheduler would: chunked prefills mixed with decodes."""
    pool = BlockPool(runner.num_blocks)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    seqs = [Sequence(seq_id=i, request_id=str(i), prompt_token_ids=p, params=params) for i, p in enumerate(prompts)]
    while any(len(s.output_token_ids) < max_tokens for s in seqs):
        scheduled = []
        for s in seqs:
            if len(s.output_token_ids) >= max_tokens:
                continue
            n = min(prefill_chunk, s.num_tokens - s.num_computed_tokens)
            pool.grow(s, s.num_computed_tokens + n)
            done = s.num_computed_tokens + n == s.num_tokens
            scheduled.append(ScheduledSeq(s, s.num_computed_tokens, n, list(s.block_table), done, None))
        out = runner.execute(SchedulerOutput(scheduled=scheduled, num_batched_tokens=sum(x.num_tokens for x in scheduled)))
        for item in scheduled:
            item.seq.num_computed_tokens += item.num_tokens
            if item.needs_sample:
                item.seq.output_token_ids.append(out.sampled[item.seq.seq_id].token_id)
        assert set(out.sampled) == {x.seq.seq_id for x in scheduled if x.needs_sample}
    return [s.output_token_ids for s in seqs]


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
            do_sample=False, pad_token_id=2,
        )
    return out[0, len(prompt):].tolist()


def test_greedy_decoding_matches_transformers(tiny_qwen2_dir, loraplex_home):
    runner = make_runner(tiny_qwen2_dir, loraplex_home)
    torch.manual_seed(0)
    prompts = [torch.randint(4, 300, (n,)).tolist() for n in (1, 5, 23, 40)]
    ours = run_greedy(runner, prompts, max_tokens=12)
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    for prompt, got in zip(prompts, ours):
        assert got == hf_greedy(hf, prompt, 12)


def test_setup_kv_sizing_and_logging(tiny_llama_dir, loraplex_home, caplog):
    with caplog.at_level(logging.INFO, logger="loraplex.engine.model_runner"):
        runner = make_runner(tiny_llama_dir, loraplex_home, kv_cache_bytes=300_000)
    spec = runner.spec
    per_token = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 4
    assert runner.kv_bytes_per_token == per_token
    assert runner.num_blocks == 300_000 // (per_token * BLOCK)
    assert runner.kv_caches[0].shape == (2, runner.num_blocks, BLOCK, spec.num_kv_heads, spec.head_dim)
    assert len(runner.kv_caches) == spec.num_layers
    assert runner.device.type == "cpu" and runner.dtype == torch.float32
    assert runner.eos_token_ids == {1}
    assert runner.max_model_len == 256 and runner.block_size == BLOCK
    assert runner.tokenizer.decode(runner.tokenizer.encode("héllo")) == "héllo"
    message = caplog.text
    assert f"{per_token} bytes per token" in message and f"{runner.num_blocks} blocks" in message
    # how many sequences fit at once is the engine's start-up line's (test_engine_exact), not here too
    assert "sequences fit" not in message and "concurrency" not in message


def test_lora_target_spec_matches_hf_modules(tiny_qwen2_dir, loraplex_home):
    runner = make_runner(tiny_qwen2_dir, loraplex_home)
    target = runner.lora_target_spec()
    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir)
    layer = hf.model.layers[0]
    modules = {**{m: getattr(layer.self_attn, m) for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
               **{m: getattr(layer.mlp, m) for m in ("gate_proj", "up_proj", "down_proj")}}
    assert target.num_layers == hf.config.num_hidden_layers
    assert target.module_shapes == {m: (mod.in_features, mod.out_features) for m, mod in modules.items()}


class FakeLoRAManager:
    """Adds ``x @ delta.T`` to o_proj's output of layer 0 for tokens of adapter "A"."""

    def __init__(self, delta: torch.Tensor):
        self.delta = delta
        self.calls: list[tuple[int, str, tuple, tuple]] = []
        self.token_adapter_ids = None

    def place(self, adapter_ids):
        self.placed = list(adapter_ids)

    def batch_order_key(self, adapter_id):
        return (-1, -1) if adapter_id is None else (8, 0)

    def prepare_step(self, token_adapter_ids):
        self.token_adapter_ids = list(token_adapter_ids)
        mask = torch.tensor([a == "A" for a in token_adapter_ids])
        manager = self

        class Ctx:
            def apply(self, layer, module, x, y):
                manager.calls.append((layer, module, tuple(x.shape), tuple(y.shape)))
                if layer == 0 and module == "o_proj":
                    y[mask] += x[mask] @ manager.delta.T

            def project(self, layer, module, x, base):
                y = base()
                self.apply(layer, module, x, y)
                return y

            def apply_embedding(self, input_ids, hidden, scale=1.0):
                pass  # no LoRA on embed_tokens in this fake

            def logits_lora(self, rows):
                return None  # nor on lm_head

        return Ctx()

    step_context = prepare_step  # what the runner calls once it has placed the step's adapters


def test_lora_hook_sees_every_linear_and_changes_output(tiny_llama_dir, loraplex_home):
    runner = make_runner(tiny_llama_dir, loraplex_home)
    spec = runner.spec
    torch.manual_seed(0)
    delta = torch.randn(spec.hidden_size, spec.q_size) * 0.05
    runner.lora_manager = FakeLoRAManager(delta)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    params = SamplingParams(temperature=0.0)
    seqs = [Sequence(seq_id=i, request_id=str(i), prompt_token_ids=p, params=params) for i, p in enumerate(prompts)]
    scheduled = [ScheduledSeq(seqs[0], 0, 5, [0], True, "A"), ScheduledSeq(seqs[1], 0, 3, [1], True, None)]
    runner.execute(SchedulerOutput(scheduled=scheduled, num_batched_tokens=8))
    manager = runner.lora_manager
    assert manager.placed == ["A", None]
    assert manager.token_adapter_ids == [None] * 3 + ["A"] * 5  # the runner orders base tokens first
    h, i, q, kv = spec.hidden_size, spec.intermediate_size, spec.q_size, spec.kv_size
    expected = []
    for layer in range(spec.num_layers):
        expected += [(layer, "qkv_proj", (8, h), (8, q + 2 * kv)), (layer, "o_proj", (8, q), (8, h)),
                     (layer, "gate_up_proj", (8, h), (8, 2 * i)), (layer, "down_proj", (8, i), (8, h))]
    assert manager.calls == expected

    # the delta must act exactly like a merged o_proj weight in transformers, and only on "A" rows
    batch = runner.prepare_batch(scheduled)
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, batch.attn, runner.kv_caches,
                              lora=manager.prepare_step(batch.token_adapter_ids))
        logits = runner.model.compute_logits(hidden)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    with torch.no_grad():
        plain = hf(torch.tensor([prompts[1]])).logits[0]
        hf.model.layers[0].self_attn.o_proj.weight += delta
        merged = hf(torch.tensor([prompts[0]])).logits[0]
    torch.testing.assert_close(logits[:5], merged, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits[5:], plain, rtol=1e-4, atol=1e-4)


def test_dtype_and_length_checks(tiny_llama_dir, loraplex_home):
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    with pytest.raises(ValueError, match="float16 is not supported on CPU"):
        resolve_dtype("float16", torch.device("cpu"))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_runner(tiny_llama_dir, loraplex_home, max_model_len=4096)
    with pytest.raises(ValueError, match="does not fit the KV cache"):
        make_runner(tiny_llama_dir, loraplex_home, kv_cache_bytes=20_000, max_model_len=512)


def test_default_max_model_len_is_lowered_to_kv_capacity(tiny_llama_dir, loraplex_home):
    runner = make_runner(tiny_llama_dir, loraplex_home, kv_cache_bytes=40_000, max_model_len=None)
    assert runner.max_model_len == runner.num_blocks * BLOCK < 1024


def test_bfloat16_runs_close_to_float32(tiny_llama_dir, loraplex_home):
    prompts = [[5, 6, 7, 8, 9, 10, 11]]
    fp32 = make_runner(tiny_llama_dir, loraplex_home)
    bf16 = make_runner(tiny_llama_dir, loraplex_home, dtype="bfloat16")
    assert bf16.kv_caches[0].dtype == torch.bfloat16
    outs = []
    for runner in (fp32, bf16):
        seq = Sequence(seq_id=0, request_id="0", prompt_token_ids=prompts[0], params=SamplingParams(temperature=0))
        batch = runner.prepare_batch([ScheduledSeq(seq, 0, 7, [0], True, None)])
        with torch.inference_mode():
            outs.append(runner.model.compute_logits(runner.model(batch.input_ids, batch.positions, batch.attn, runner.kv_caches)))
    assert outs[1].dtype == torch.float32
    assert ((outs[1] - outs[0]).abs().max() / outs[0].abs().max()).item() < 0.05
