"""Phi-3 (``Phi3ForCausalLM``) against transformers' own Phi-3 from the same random weights (fp32,
CPU): logits of a prefill and of a mixed prefill-chunk/decode step over the paged cache, with full
and partial rotary, LongRoPE within the original context, tied embeddings, published config forms
(``su``, top-level ``rope_theta``), GQA with unequal q/k/v widths; the LongRoPE table on both
sides of the original context; the sliding window; config refusals as transformers refuses."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.model.config import ModelSpec, UnsupportedModelError
from loraplex.model.loader import load_model, read_safetensors
from loraplex.model.rope import RotaryEmbedding
from tests.fixtures.tiny_phi3 import PHI3_SHAPE, longrope_scaling, make_tiny_phi3_dir, phi3_hf_config
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

BLOCK_SIZE = 16
ORIGINAL = 256  # original_max_position_embeddings of the LongRoPE variants (max positions 1024)
LONGROPE = dict(rope_scaling=longrope_scaling(8), original_max_position_embeddings=ORIGINAL)
VARIANTS = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "partial-rotary": {"partial_rotary_factor": 0.75},
    "longrope": LONGROPE,
    # Phi-4-mini's kind: LongRoPE over a partial rotary (12 of 16 dims: 6 factors), tied head
    "phi4-mini-like": dict(
        rope_scaling=longrope_scaling(6), original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=0.75, tie_word_embeddings=True,
    ),
    # as Phi-3.5-mini's config.json is published: rope_scaling without the original context
    # (top-level only), top-level rope_theta
    "published-form": dict(**LONGROPE, config_json={
        "rope_parameters": None, "rope_theta": 10000.0, "rope_scaling": longrope_scaling(8),
    }),
    # an attention_factor given in the config replaces the derived one
    "longrope-attention-factor": dict(
        rope_scaling=longrope_scaling(8, attention_factor=1.7), original_max_position_embeddings=ORIGINAL,
    ),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request, tmp_path_factory):
    model_dir = make_tiny_phi3_dir(tmp_path_factory.mktemp(request.param), seed=1, **VARIANTS[request.param])
    spec = ModelSpec.from_dir(model_dir)
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=512)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert type(ref).__name__ == "Phi3ForCausalLM"
    return spec, ours, ref


def ref_logits(ref, token_ids: list[int]) -> torch.Tensor:  # [len, vocab]
    with torch.no_grad():
        return ref(torch.tensor([token_ids])).logits[0].float()


def test_prefill_logits_match_transformers(variant):
    spec, ours, ref = variant
    torch.manual_seed(0)
    tokens = torch.randint(0, spec.vocab_size, (150,)).tolist()
    positions, attn = chunk_metadata([(0, len(tokens), [5, 2, 9, 0, 7, 3, 11, 1, 4, 6])], BLOCK_SIZE)
    logits = ours.compute_logits(ours(torch.tensor(tokens), positions, attn, new_kv_caches(spec, 12, BLOCK_SIZE)))
    assert relative_error(logits, ref_logits(ref, tokens)) < 1e-4


def test_mixed_step_matches_transformers(variant):
    """A prompt chunk over its cached prefix and two decodes in one step, rows against the full
    sequences' logits."""
    spec, ours, ref = variant
    torch.manual_seed(1)
    seq_a, seq_b = (torch.randint(0, spec.vocab_size, (n,)).tolist() for n in (45, 18))
    tables = {"a": [3, 8, 1], "b": [6, 0]}
    kv = new_kv_caches(spec, 10, BLOCK_SIZE)
    positions, attn = chunk_metadata([(0, 20, tables["a"]), (0, 17, tables["b"])], BLOCK_SIZE)
    ours(torch.tensor(seq_a[:20] + seq_b[:17]), positions, attn, kv)
    positions, attn = chunk_metadata([(20, 25, tables["a"]), (17, 1, tables["b"])], BLOCK_SIZE)
    logits = ours.compute_logits(ours(torch.tensor(seq_a[20:] + seq_b[17:]), positions, attn, kv))
    expected = torch.cat([ref_logits(ref, seq_a)[20:], ref_logits(ref, seq_b)[17:]])
    assert relative_error(logits, expected) < 1e-4


@pytest.mark.parametrize("partial", [1.0, 0.75])
def test_longrope_table_is_short_below_the_original_context_and_long_from_it(partial):
    """transformers' rotary module picks the factor list by the longest position it is given:
    positions 0..ORIGINAL-1 alone get the short list, ORIGINAL.. the long one. loraplex's table
    holds exactly those rows, with transformers' attention factor on both."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    num_factors = int(16 * partial) // 2
    config = phi3_hf_config(
        rope_scaling=longrope_scaling(num_factors), original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=partial,
    )
    hf = Phi3RotaryEmbedding(config)
    spec = ModelSpec.from_dict(config.to_dict())
    ours = RotaryEmbedding(spec.rope, spec.head_dim, 1024, torch.float32, "cpu")
    assert spec.rope.scaling["attention_factor"] == hf.attention_scaling == math.sqrt(1 + math.log(4) / math.log(256))
    x = torch.zeros(1, 1, 16)
    for span in (range(0, ORIGINAL), range(ORIGINAL, 1024)):
        cos, sin = hf(x, torch.tensor([list(span)]))
        assert torch.equal(ours.cos[span.start:span.stop], cos[0])
        assert torch.equal(ours.sin[span.start:span.stop], sin[0])
    # the switch matters: with the long list, position ORIGINAL - 1 would rotate otherwise
    long_cos, _ = hf(x, torch.tensor([[ORIGINAL - 1, ORIGINAL]]))
    assert not torch.allclose(ours.cos[ORIGINAL - 1], long_cos[0, 0])


def test_original_context_is_read_as_transformers_reads_it():
    """The top-level ``original_max_position_embeddings`` wins over the rope dict's, and when the
    config has none, Phi3Config's default 4096 applies (here: factor 1024/4096 < 1, so the
    attention factor is 1)."""
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    scaling = longrope_scaling(8, original_max_position_embeddings=64)
    for top_level in (ORIGINAL, None):
        config = phi3_hf_config(rope_scaling=scaling, original_max_position_embeddings=ORIGINAL)
        raw = config.to_dict()
        raw["rope_parameters"] = dict(scaling, rope_type="longrope")
        if top_level is None:
            del raw["original_max_position_embeddings"]
        hf = Phi3RotaryEmbedding(type(config).from_dict(raw))
        spec = ModelSpec.from_dict(raw)
        assert spec.rope.scaling["original_max_position_embeddings"] == (top_level or 4096)
        assert spec.rope.scaling["attention_factor"] == hf.attention_scaling


def test_su_is_longrope():
    """Older Phi-3-mini-128k revisions say ``su``; Phi3Config renames it (transformers 5.24 then
    fails its own check for a dict without the original context, so no model to compare)."""
    raw = {**phi3_hf_config().to_dict(), "rope_parameters": None, "original_max_position_embeddings": ORIGINAL}
    su = ModelSpec.from_dict({**raw, "rope_scaling": longrope_scaling(8, rope_type="su")})
    longrope = ModelSpec.from_dict({**raw, "rope_scaling": longrope_scaling(8)})
    assert su.rope == longrope.rope and su.rope.rope_type == "longrope"


def test_sliding_window_is_a_real_window(tmp_path):
    """Phi-3-mini-4k's kind: transformers masks attention to the window; so does loraplex, which
    serves all the positions and matches transformers within the window and past it."""
    model_dir = make_tiny_phi3_dir(tmp_path / "windowed", seed=2, sliding_window=40)
    spec = ModelSpec.from_dir(model_dir)
    assert spec.sliding_window == 40 and spec.max_context_len == spec.max_position_embeddings
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=64)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(3)
    tokens = torch.randint(0, spec.vocab_size, (56,)).tolist()
    positions, attn = chunk_metadata([(0, 40, [0, 1, 2])], BLOCK_SIZE)
    logits = ours.compute_logits(ours(torch.tensor(tokens[:40]), positions, attn, new_kv_caches(spec, 4, BLOCK_SIZE)))
    assert relative_error(logits, ref_logits(ref, tokens[:40])) < 1e-4
    positions, attn = chunk_metadata([(0, 56, [0, 1, 2, 3])], BLOCK_SIZE)
    past = ours.compute_logits(ours(torch.tensor(tokens), positions, attn, new_kv_caches(spec, 4, BLOCK_SIZE)))
    assert relative_error(past, ref_logits(ref, tokens)) < 1e-4
    wide = ModelSpec.from_dict(phi3_hf_config(sliding_window=262144).to_dict())  # the 128k models'
    assert wide.sliding_window is None and wide.max_context_len == PHI3_SHAPE["max_position_embeddings"]


def test_fused_checkpoint_tensors_are_the_packed_projections(tmp_path):
    model_dir = make_tiny_phi3_dir(tmp_path / "m", seed=4)
    spec = ModelSpec.from_dir(model_dir)
    model = load_model(model_dir, spec, torch.float32, "cpu", 64)
    raw = read_safetensors(model_dir)
    assert "model.layers.1.self_attn.q_proj.weight" not in raw
    assert torch.equal(model.layers[1].qkv_weight, raw["model.layers.1.self_attn.qkv_proj.weight"])
    assert torch.equal(model.layers[1].gate_up_weight, raw["model.layers.1.mlp.gate_up_proj.weight"])
    assert model.layers[1].qkv_weight.shape == (64 + 2 * 32, 64)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(rope_scaling={"type": "linear", "factor": 2.0}),
         "rope type 'linear'; loraplex supports default, longrope"),
        (dict(rope_scaling=longrope_scaling(8), original_max_position_embeddings=ORIGINAL,
              partial_rotary_factor=0.75), "short_factor' has 8 entries; the rotary dimension 12 needs 6"),
        (dict(rope_scaling={**longrope_scaling(8), "long_factor": None}), "long_factor"),
    ],
)
def test_configs_transformers_cannot_run_are_refused(overrides, message):
    raw = {**phi3_hf_config().to_dict(), "rope_scaling": None, "rope_parameters": None}
    raw.update({k: v for k, v in overrides.items()})
    with pytest.raises(UnsupportedModelError, match=message):
        ModelSpec.from_dict(raw)
    with pytest.raises(Exception):  # transformers refuses it too (its errors vary by case)
        from transformers import Phi3Config, Phi3ForCausalLM

        Phi3ForCausalLM(Phi3Config.from_dict(raw))(torch.tensor([[1, 2, 3]]))


def test_longrope_and_partial_rotary_stay_phi3_only():
    llama = {"architectures": ["LlamaForCausalLM"], **{k: PHI3_SHAPE[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")}}
    with pytest.raises(UnsupportedModelError, match="Phi-3 only"):
        ModelSpec.from_dict({**llama, "partial_rotary_factor": 0.5})
    with pytest.raises(UnsupportedModelError, match="unsupported rope type 'longrope'"):
        ModelSpec.from_dict({**llama, "rope_scaling": {**longrope_scaling(8), "original_max_position_embeddings": 64}})
    spec = ModelSpec.from_dict({"model_type": "phi3", **{k: v for k, v in llama.items() if k != "architectures"}})
    assert spec.architecture == "Phi3ForCausalLM"


def test_engine_greedy_matches_transformers(tmp_path, loraplex_home):
    """Phi-4-mini's kind through the whole engine (chunked prompts, preemption, paged decodes):
    greedy tokens equal transformers' greedy decoding, within LongRoPE's original context."""
    from loraplex.sampling_params import SamplingParams
    from tests.engine.test_engine_exact import tight_llm
    from tests.lora.test_acceptance import greedy

    model_dir = make_tiny_phi3_dir(tmp_path / "phi4", seed=6, **VARIANTS["phi4-mini-like"])
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(4)
    prompts = [torch.randint(4, 300, (n,)).tolist() for n in (3, 17, 90, 41)]
    llm = tight_llm(model_dir, loraplex_home, num_blocks=16)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy(ref, p, 10) for p in prompts]
