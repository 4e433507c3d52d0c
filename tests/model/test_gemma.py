"""Gemma 1, Gemma 2 and Gemma 3 (text) against transformers' own models from the same random
small configs (float32, CPU, eager attention): config keys read as transformers reads them,
logits of a prefill and of a mixed prefill + decode step, greedy tokens through the engine and
logprobs of soft-capped logits. The tiny models (``tests.fixtures.tiny_models.GEMMA_SHAPE``)
window 24 positions on layers 0 and 2, and the prompts run past the window."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

from loraplex.model.config import ModelSpec, UnsupportedModelError
from loraplex.model.loader import load_model
from loraplex.sampling_params import SamplingParams
from tests.engine.test_engine_exact import tight_llm
from tests.engine.test_prompt_logprobs import check, reference
from tests.fixtures.tiny_models import make_tiny_model_dir
from tests.lora.test_acceptance import greedy
from tests.model.helpers import assert_sampled_logprobs, chunk_metadata, new_kv_caches, relative_error

BLOCK_SIZE = 16
SHAPE = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=26, num_attention_heads=8,
             num_key_value_heads=4, head_dim=256)


def test_gemma2_hub_config_reads_as_transformers_does():
    """gemma-2-2b-it's keys (no layer_types, no tie key): windows on even layers, both caps,
    query_pre_attn_scalar's scale, tied head."""
    cfg = {"architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", **SHAPE, "hidden_act": "gelu_pytorch_tanh",
           "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 224, "sliding_window": 4096,
           "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "rope_theta": 10000.0}
    spec = ModelSpec.from_dict(cfg)
    hf = Gemma2Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type", "rope_theta")})
    assert spec.gemma.layer_types == tuple(hf.layer_types)
    assert [spec.gemma.layer_window(i) for i in range(3)] == [4096, None, 4096]
    assert (spec.gemma.attn_logit_softcap, spec.gemma.final_logit_softcap) == (50.0, 30.0)
    assert spec.softmax_scale == 224**-0.5 and spec.head_dim == 256
    assert spec.tie_word_embeddings is hf.tie_word_embeddings is True
    assert spec.max_context_len == spec.max_position_embeddings  # the window does not cap the context


def test_gemma3_hub_config_reads_as_transformers_does():
    """gemma-3-1b-it's keys: sliding_window_pattern 6, rope_local_base_freq for the windowed
    layers, rope_theta and (4b and up) linear scaling for the global ones, no soft-caps."""
    keys = dict(SHAPE, sliding_window=512, sliding_window_pattern=6, rope_local_base_freq=10000.0,
                rope_theta=1_000_000.0, rope_scaling={"rope_type": "linear", "factor": 8.0},
                final_logit_softcapping=None, attn_logit_softcapping=None, query_pre_attn_scalar=256)
    spec = ModelSpec.from_dict({"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", **keys})
    hf = Gemma3TextConfig(**keys)
    assert spec.gemma.layer_types == tuple(hf.layer_types)
    assert spec.gemma.layer_types[:6] == ("sliding_attention",) * 5 + ("full_attention",)
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (spec.rope.rope_type, spec.rope.theta, spec.rope.scaling["factor"]) == ("linear", full["rope_theta"], 8.0)
    assert (spec.gemma.rope_local.rope_type, spec.gemma.rope_local.theta) == ("default", local["rope_theta"])
    assert spec.qk_norm and spec.gemma.attn_logit_softcap is None and spec.gemma.final_logit_softcap is None


def test_gemma_activation_keys_read_as_transformers_does():
    """Gemma 1 reads hidden_act and takes its legacy "gelu" as the tanh approximation; Gemma 2
    reads hidden_activation, where "gelu" is the exact one."""
    from transformers import GemmaConfig
    from transformers.activations import ACT2FN

    def approximate(arch: str, **keys) -> str:
        return ModelSpec.from_dict({"architectures": [arch], **SHAPE, **keys}).gemma.gelu_approximate

    assert GemmaConfig(hidden_act="gelu").hidden_act == "gelu_pytorch_tanh"
    assert approximate("GemmaForCausalLM", hidden_act="gelu", hidden_activation=None) == "tanh"
    x = torch.linspace(-4, 4, 9)
    exact = ACT2FN[Gemma2Config(hidden_activation="gelu").hidden_activation](x)
    assert approximate("Gemma2ForCausalLM", hidden_act="gelu_pytorch_tanh", hidden_activation="gelu") == "none"
    assert torch.equal(exact, torch.nn.functional.gelu(x, approximate="none"))
    assert approximate("Gemma2ForCausalLM", hidden_activation=None) == "tanh"


@pytest.mark.parametrize(
    "arch, key, value",
    [
        ("Gemma2ForCausalLM", "hidden_activation", "relu"),
        ("Gemma2ForCausalLM", "attn_logit_softcapping", 0.0),
        ("Gemma2ForCausalLM", "final_logit_softcapping", -30.0),
        ("Gemma2ForCausalLM", "query_pre_attn_scalar", "256"),
        ("Gemma2ForCausalLM", "layer_types", ["sliding_attention"] * 3),
        ("Gemma3ForCausalLM", "layer_types", ["chunked_attention"] * 26),
        ("Gemma2ForCausalLM", "sliding_window", 0),
        ("Gemma3ForCausalLM", "sliding_window", 512.5),
        ("Gemma3ForCausalLM", "use_bidirectional_attention", True),
    ],
)
def test_unservable_gemma_options_are_refused(arch, key, value):
    cfg = {"architectures": [arch], **SHAPE, "sliding_window": 4096, key: value}
    with pytest.raises(UnsupportedModelError, match=key if key != "use_bidirectional_attention" else "bidirectional"):
        ModelSpec.from_dict(cfg)


@pytest.fixture(scope="module", params=["gemma", "gemma2", "gemma3"])
def variant(request, tmp_path_factory):
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    spec = ModelSpec.from_dir(model_dir)
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=512)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    return model_dir, spec, ours, ref


def ref_logits(ref, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.no_grad():
        return ref(torch.tensor([token_ids])).logits[0].float()


def prefill_logits(model, spec, tokens: list[int]) -> torch.Tensor:  # [len, vocab]
    table = [5, 2, 9, 0, 7, 3, 11, 1, 4, 6]  # scattered blocks: paging must not matter
    positions, attn = chunk_metadata([(0, len(tokens), table)], BLOCK_SIZE)
    return model.compute_logits(model(torch.tensor(tokens), positions, attn, new_kv_caches(spec, 12, BLOCK_SIZE)))


def test_prefill_logits_match_transformers(variant):
    _, spec, ours, ref = variant
    tokens = torch.randint(0, spec.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    assert relative_error(prefill_logits(ours, spec, tokens), ref_logits(ref, tokens)) < 1e-4


def test_mixed_step_matches_transformers(variant):
    """Step 1 prefills A's first 20 tokens and all but one of B and C; step 2 runs A's next 25
    (over its cached prefix, past the window) with one decode each of B (position 40) and C."""
    _, spec, ours, ref = variant
    gen = torch.Generator().manual_seed(1)
    seq_a, seq_b, seq_c = (torch.randint(0, spec.vocab_size, (n,), generator=gen).tolist() for n in (45, 41, 33))
    tables = {"a": [3, 8, 1], "b": [6, 0, 5], "c": [2, 9, 4]}
    kv = new_kv_caches(spec, 10, BLOCK_SIZE)
    positions, attn = chunk_metadata([(0, 20, tables["a"]), (0, 40, tables["b"]), (0, 32, tables["c"])], BLOCK_SIZE)
    ours(torch.tensor(seq_a[:20] + seq_b[:40] + seq_c[:32]), positions, attn, kv)
    positions, attn = chunk_metadata([(20, 25, tables["a"]), (40, 1, tables["b"]), (32, 1, tables["c"])], BLOCK_SIZE)
    logits = ours.compute_logits(ours(torch.tensor(seq_a[20:] + seq_b[40:] + seq_c[32:]), positions, attn, kv))
    expected = torch.cat([ref_logits(ref, seq_a)[20:], ref_logits(ref, seq_b)[40:], ref_logits(ref, seq_c)[32:]])
    assert relative_error(logits, expected) < 1e-4


def _without(spec: ModelSpec, **gemma_changes) -> ModelSpec:
    return dataclasses.replace(spec, gemma=dataclasses.replace(spec.gemma, **gemma_changes))


@pytest.mark.parametrize(
    "kind, change",
    [
        ("gemma2", dict(sliding_window=None)),
        ("gemma2", dict(attn_logit_softcap=None)),
        ("gemma2", dict(final_logit_softcap=None)),
        ("gemma3", dict(sliding_window=None)),
        ("gemma3", dict(rope_local=None)),
    ],
)
def test_each_gemma_feature_changes_these_logits(kind, change, tmp_path):
    """Without the window, a soft-cap or Gemma 3's local rope, the tiny models' logits would be
    far from transformers': the exactness tests above exercise each feature."""
    model_dir = make_tiny_model_dir(tmp_path / kind, kind, seed=1)
    spec = _without(ModelSpec.from_dir(model_dir), **change)
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=512)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = torch.randint(0, spec.vocab_size, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    assert relative_error(prefill_logits(ours, spec, tokens), ref_logits(ref, tokens)) > 1e-2


def test_greedy_generation_matches_transformers(variant, loraplex_home):
    """Chunked prompts (64 tokens a step), then decodes through the paged KV cache, past the window."""
    model_dir, _, _, ref = variant
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (3, 17, 90, 41)]
    llm = tight_llm(model_dir, loraplex_home, num_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy(ref, p, 10) for p in prompts]


def test_gemma2_logprobs_are_of_soft_capped_logits(tmp_path, loraplex_home):
    """Sampled and prompt logprobs are the log-softmax of transformers' logits after the final
    soft-cap (0.8 here: the uncapped logits' logprobs would be far off)."""
    model_dir = make_tiny_model_dir(tmp_path / "gemma2", "gemma2", seed=2)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    prompt = torch.randint(4, 300, (70,), generator=torch.Generator().manual_seed(5)).tolist()
    llm = tight_llm(model_dir, loraplex_home, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    out = llm.generate(prompt, params)[0]
    check(out.prompt_logprobs, prompt, reference(ref, prompt))
    assert_sampled_logprobs(ref, prompt, out, 3, ordered=True)
