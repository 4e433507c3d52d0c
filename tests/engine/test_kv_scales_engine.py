"""Calibrated fp8 KV-cache scales end to end on the engine (CPU, float32 compute).

1. Against transformers: a tiny Llama whose keys and values are hundreds of times larger than
   usual (k_proj and v_proj scaled up, q_proj and o_proj down by the same factor, so the fp32
   model computes what the original does) has K/V far beyond e4m3's 448. With the per-layer
   scales a calibration would store (amax / 448 of transformers' own post-RoPE K and V over the
   prompts, written into the checkpoint as ``self_attn.k_scale`` / ``v_scale``) the fp8 engine's
   logprobs stay close to transformers' fp32 ones; without them (scale 1.0) K/V saturate and the
   logprobs are far off.
2. Against the engine itself: with scales, the fp8 cache generates what the model's-dtype cache
   generates when each K/V write is first rounded as vLLM's write does (``x / scale``, clamped,
   torch's fp8 cast, times the scale), through chunked prefill, prefix-cache hits, preemption's
   recompute, n-gram verification and Gemma 2's windowed layer groups: same bytes, same tokens.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from loraplex.engine.llm import LLM
from loraplex.kernels import dispatch
from loraplex.sampling_params import SamplingParams
from tests.engine.spec_helpers import NGRAM, repeating_prompts
from tests.engine.test_fp8_kv_engine import FP8, assert_same, logprobs, prompts_with_shared_prefix, run
from tests.fixtures.tiny_models import make_tiny_model_dir

E4M3_MAX = 448.0
BLOW_UP = 1000.0  # K and V this many times larger; scores and outputs unchanged


def edit_weights(model_dir, change) -> None:
    (weights,) = model_dir.glob("*.safetensors")
    tensors = load_file(weights)
    change(tensors)
    save_file(tensors, weights, metadata={"format": "pt"})


def num_layers(model_dir) -> int:
    return json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]


def blow_up_kv(tensors: dict[str, torch.Tensor]) -> None:
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * BLOW_UP
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            tensors[name] = tensors[name] / BLOW_UP


def kv_amax(hf, prompts) -> list[tuple[float, float]]:
    """Per layer, the largest |K| and |V| transformers puts in its cache (post-RoPE K) over ``prompts``."""
    amax: list[list[float]] = []
    with torch.no_grad():
        for prompt in prompts:
            cache = hf(torch.tensor([prompt]), use_cache=True).past_key_values
            for i, layer in enumerate(cache.layers):
                k, v = layer.keys.abs().max().item(), layer.values.abs().max().item()
                if len(amax) <= i:
                    amax.append([0.0, 0.0])
                amax[i] = [max(amax[i][0], k), max(amax[i][1], v)]
    return [(k, v) for k, v in amax]


def logprob_errors(hf, prompts, outs) -> list[float]:
    """|engine - transformers| of the logprob of every prompt token (after the first) and every
    generated token, transformers teacher-forced on the engine's own tokens."""
    errors = []
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            generated = out.outputs[0].token_ids
            ids = prompt + generated
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)  # [len, vocab]
            for pos, entry in enumerate(out.prompt_logprobs[1:], start=1):
                errors.append(abs(entry["logprob"] - ref[pos - 1, prompt[pos]].item()))
            for j, entry in enumerate(out.outputs[0].logprobs):
                errors.append(abs(entry["logprob"] - ref[len(prompt) - 1 + j, generated[j]].item()))
    return errors


def test_calibrated_scales_keep_fp8_logprobs_near_transformers(tmp_path, loraplex_home):
    model_dir = make_tiny_model_dir(tmp_path / "big-kv", "llama", seed=9)
    edit_weights(model_dir, blow_up_kv)
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (37, 23, 50)]
    amax = kv_amax(hf, prompts)
    assert min(min(pair) for pair in amax) > 4 * E4M3_MAX  # every layer's K and V overflow e4m3 at scale 1.0
    scales = [(k / E4M3_MAX, v / E4M3_MAX) for k, v in amax]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1)

    def fp8_errors(home) -> list[float]:
        llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, kv_cache_dtype="fp8",
                  kv_cache_bytes=1 << 20)
        return logprob_errors(hf, prompts, llm.generate(prompts, params))

    saturated = fp8_errors(tmp_path / "h1")
    edit_weights(model_dir, lambda t: t.update({
        f"model.layers.{i}.self_attn.{name}": torch.tensor(s[j], dtype=torch.float32)
        for i, s in enumerate(scales) for j, name in enumerate(("k_scale", "v_scale"))}))
    llm = LLM(model=str(model_dir), dtype="float32", device="cpu", home=tmp_path / "h2", kv_cache_dtype="fp8",
              kv_cache_bytes=1 << 20)
    flat = [x for pair in llm.engine.runner.model.kv_scales for x in pair]
    assert flat == pytest.approx([x for pair in scales for x in pair])
    calibrated = logprob_errors(hf, prompts, llm.generate(prompts, params))
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    # e4m3 keeps 3 mantissa bits: small errors remain (measured: max 0.05, mean 0.016); saturation
    # is more than an order of magnitude worse (max 1.5, mean 0.38)
    assert max(calibrated) < 0.15 and mean(calibrated) < 0.04, (max(calibrated), mean(calibrated))
    assert mean(saturated) > 5 * mean(calibrated) and max(saturated) > max(calibrated), (
        mean(saturated), mean(calibrated))


# every layer's (k_scale, v_scale), as the checkpoint stores them (float32); K/V of these models
# reach a few hundred times them
SCALES = tuple(float(torch.tensor(s)) for s in (0.0071, 0.0123))


def round_kv_writes_scaled(monkeypatch, kind: str, k_scale: float, v_scale: float) -> None:
    """From now on every KV write stores K/V as an fp8 cache with these scales reads them back."""
    fp8, limit = FP8[kind]
    write = dispatch.write_kv_cache

    def rounded(x: torch.Tensor, s: float) -> torch.Tensor:
        return ((x.float() / s).clamp(-limit, limit).to(fp8).float() * s).to(x.dtype)

    monkeypatch.setattr(dispatch, "write_kv_cache", lambda k, v, cache, slots, *scales: write(
        rounded(k, k_scale), rounded(v, v_scale), cache, slots, *scales))


@pytest.fixture(scope="module")
def scaled_models(tmp_path_factory):
    """Tiny Llama and Gemma 2 (windowed layer groups) with ``SCALES`` on every layer."""
    s, f = "sliding_attention", "full_attention"
    models = {
        "llama": make_tiny_model_dir(tmp_path_factory.mktemp("llama-kvs"), "llama", seed=5),
        "gemma2": make_tiny_model_dir(tmp_path_factory.mktemp("gemma2-kvs"), "gemma2", seed=6, sliding_window=10,
                                      num_hidden_layers=4, layer_types=[s, f, s, f]),
    }
    for model_dir in models.values():
        edit_weights(model_dir, lambda t, n=num_layers(model_dir): t.update({
            f"model.layers.{i}.self_attn.{name}": torch.tensor(v) for i in range(n)
            for name, v in zip(("k_scale", "v_scale"), SCALES)}))
    return models


CASES = {
    "llama_e4m3": ("llama", "fp8", {}),
    "llama_e5m2": ("llama", "fp8_e5m2", {}),
    "llama_e4m3_ngram": ("llama", "fp8", {"speculative_config": NGRAM}),
    "gemma2_windows_e4m3": ("gemma2", "fp8", {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_scaled_fp8_cache_generates_what_scaled_rounding_generates(name, scaled_models, loraplex_home, monkeypatch):
    model, kind, options = CASES[name]
    model_dir = scaled_models[model]
    prompts = repeating_prompts(4) if "speculative_config" in options else prompts_with_shared_prefix()
    got, llm = run(model_dir, loraplex_home, kind, 24, prompts, **options)
    assert llm.engine.runner.model.kv_scales == [SCALES] * num_layers(model_dir)
    stats = llm.engine.stats()
    assert stats["num_chunked_prefills"] > 0, stats
    if "speculative_config" in options:
        assert stats["spec_decode_num_accepted_tokens"] > 0, stats
    else:
        assert stats["prefix_cache_hits"] > 0 and stats["num_preemptions"] > 0, stats
    with monkeypatch.context() as unscaled:  # the check can fail: scale-1.0 rounding is another model
        round_kv_writes_scaled(unscaled, kind, 1.0, 1.0)
        plain, _ = run(model_dir, loraplex_home, "auto", 24, prompts, **options)
    round_kv_writes_scaled(monkeypatch, kind, *SCALES)
    want, _ = run(model_dir, loraplex_home, "auto", 24, prompts, **options)
    assert_same(got, want)
    diffs = [abs(a - b) for x, y in zip(logprobs(plain), logprobs(want)) for a, b in zip(x, y)]
    assert max(diffs) > 1e-3


def test_scaled_fp8_beam_search_is_scaled_rounding_beam_search(scaled_models, loraplex_home, monkeypatch):
    """Beam search forks its beams over shared prefix pages: with scales the same bytes are read
    by every fork, so beams and their scores equal the scaled-rounding reference."""
    from loraplex import BeamSearchParams

    prompts = [{"prompt_token_ids": p} for p in ([5, 6, 7], list(range(10, 180, 10)))]
    params = BeamSearchParams(beam_width=3, max_tokens=6)

    def search(kind: str):
        llm = LLM(model=str(scaled_models["llama"]), dtype="float32", device="cpu", home=loraplex_home,
                  kv_cache_dtype=kind, kv_cache_bytes=1 << 20, block_size=4, max_num_seqs=8)
        outs = llm.beam_search(prompts, params)
        assert llm.engine.stats()["prefix_cache_hits"] > 0
        return [[(s.output_token_ids, s.cum_logprob) for s in out.sequences] for out in outs]

    got = search("fp8")
    round_kv_writes_scaled(monkeypatch, "fp8", *SCALES)
    want = search("auto")
    assert [[t for t, _ in beams] for beams in got] == [[t for t, _ in beams] for beams in want]
    for g, w in zip(got, want):
        assert [c for _, c in g] == pytest.approx([c for _, c in w], abs=2e-5)
