"""``kv_cache_dtype`` fp8 / fp8_e5m2 end to end on the engine (CPU, float32 compute).

Reference: the same engine with the model's-dtype cache, whose every K/V write is first rounded
through the fp8 format by torch's own cast (clamped to the finite maximum, the saturation vLLM's
conversion applies): storing one byte per element must compute exactly that, so greedy tokens
are equal and logprobs agree to float noise, through chunked prefill, prefix-cache hits,
preemption (recompute), n-gram speculative decoding (its verify step writes KV) and, on Gemma 2,
windowed layer groups and soft-capping. A plain run of the model's-dtype cache differs (the check
can fail). The KV pool holds four times fp32's blocks (twice bf16's) in the same bytes."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex.engine.kv_layout import KVLayout
from loraplex.engine.llm import LLM
from loraplex.kernels import dispatch
from loraplex.model.config import ModelSpec
from loraplex.sampling_params import SamplingParams
from tests.engine.spec_helpers import NGRAM, repeating_prompts
from tests.fixtures.tiny_models import make_tiny_model_dir

FP8 = {"fp8": (torch.float8_e4m3fn, 448.0), "fp8_e5m2": (torch.float8_e5m2, 57344.0)}
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)
BLOCK = 4


def page_bytes(model_dir, itemsize: int) -> int:
    """Bytes of one KV page: a block of tokens for one layer group's layers (K and V)."""
    spec = ModelSpec.from_dir(model_dir)
    group_size = KVLayout.from_layer_windows(spec.layer_windows).group_size
    return 2 * group_size * spec.num_kv_heads * spec.head_dim * itemsize * BLOCK


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama-fp8"), "llama", seed=5)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
    s, f = "sliding_attention", "full_attention"
    return make_tiny_model_dir(tmp_path_factory.mktemp("gemma2-fp8"), "gemma2", seed=6, sliding_window=10,
                               num_hidden_layers=4, layer_types=[s, f, s, f])


def prompts_with_shared_prefix() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(4, 300, (23,), generator=gen).tolist()  # past the 10-token window
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (5, 41)]
    return prompts + [shared + torch.randint(4, 300, (n,), generator=gen).tolist() for n in (3, 14, 30)]


def run(model_dir, home, kv_cache_dtype: str, num_pages: int, prompts, **options):
    """(outputs, LLM) with ``num_pages`` KV pages whatever the dtype, so every run schedules alike."""
    itemsize = 1 if kv_cache_dtype != "auto" else 4
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, block_size=BLOCK,
              kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=num_pages * page_bytes(model_dir, itemsize),
              max_num_batched_tokens=16, max_num_seqs=8, **options)
    assert llm.engine.runner.num_blocks == num_pages
    return llm.generate(prompts, PARAMS), llm


def round_kv_writes(monkeypatch, kind: str) -> None:
    """From now on every KV write stores K/V rounded through ``kind`` (the cache keeps its dtype)."""
    fp8, limit = FP8[kind]
    write = dispatch.write_kv_cache

    def rounded(x: torch.Tensor) -> torch.Tensor:
        return x.float().clamp(-limit, limit).to(fp8).to(x.dtype)

    monkeypatch.setattr(dispatch, "write_kv_cache",
                        lambda k, v, cache, slots, *scales: write(rounded(k), rounded(v), cache, slots, *scales))


def logprobs(outputs) -> list[list[float]]:
    return [[entry["logprob"] for entry in out.outputs[0].logprobs] for out in outputs]


def tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


def assert_same(got, want) -> None:
    assert tokens(got) == tokens(want)
    for a, b in zip(logprobs(got), logprobs(want)):
        assert a == pytest.approx(b, abs=2e-5)


CASES = {
    # 24 pages of 4 tokens for 5 prompts up to 53 + 20 tokens: chunks, prefix hits and preemption
    "llama_e4m3": ("llama", "fp8", {}),
    "llama_e5m2": ("llama", "fp8_e5m2", {}),
    "llama_e4m3_ngram": ("llama", "fp8", {"speculative_config": NGRAM}),
    "gemma2_windows_e4m3": ("gemma2", "fp8", {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_cache_generates_what_fp8_rounded_kv_generates(name, request, loraplex_home, monkeypatch):
    model, kind, options = CASES[name]
    model_dir = request.getfixturevalue(model)
    prompts = repeating_prompts(4) if "speculative_config" in options else prompts_with_shared_prefix()
    num_pages = 24
    got, llm = run(model_dir, loraplex_home, kind, num_pages, prompts, **options)
    assert {t.dtype for t in llm.engine.runner.kv_storage} == {FP8[kind][0]}
    stats = llm.engine.stats()
    assert stats["num_chunked_prefills"] > 0, stats
    if "speculative_config" in options:
        assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    else:
        assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    plain, _ = run(model_dir, loraplex_home, "auto", num_pages, prompts, **options)
    round_kv_writes(monkeypatch, kind)
    want, _ = run(model_dir, loraplex_home, "auto", num_pages, prompts, **options)
    assert_same(got, want)
    # the fp8 cache is not the model's-dtype cache: some logprob moves by far more than the tolerance
    diffs = [abs(a - b) for x, y in zip(logprobs(plain), logprobs(want)) for a, b in zip(x, y)]
    assert max(diffs) > 1e-3


@pytest.mark.parametrize("dtype,kind,factor", [
    ("float32", "fp8", 4), ("float32", "fp8_e4m3", 4), ("float32", "fp8_e5m2", 4), ("bfloat16", "fp8", 2),
])
def test_same_bytes_hold_more_blocks(llama, loraplex_home, dtype, kind, factor):
    budget = 3 << 20
    config = json.loads((llama / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    fp8_page = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 1 * 16  # bytes

    def blocks(kv_cache_dtype: str) -> int:
        llm = LLM(model=str(llama), dtype=dtype, device="cpu", home=loraplex_home, kv_cache_bytes=budget,
                  kv_cache_dtype=kv_cache_dtype)
        runner = llm.engine.runner
        assert runner.kv_bytes_per_token == fp8_page // 16 * (factor if kv_cache_dtype == "auto" else 1)
        return runner.num_blocks

    fp8_blocks = blocks(kind)
    assert fp8_blocks == budget // fp8_page
    assert fp8_blocks == factor * blocks("auto")
