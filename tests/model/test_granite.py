"""Granite (``GraniteForCausalLM``): its four multipliers parsed and refused where they cannot be
honoured, and the engine's outputs against transformers' own Granite (float32, CPU): greedy
tokens, generated-token logprobs and prompt logprobs (the log-softmax of the logits after
``logits_scaling``). Logits per position, prefill and paged decode: ``test_llama_logits``."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from loraplex.model.config import ModelSpec, UnsupportedModelError
from loraplex.sampling_params import SamplingParams
from tests.engine.test_engine_exact import tight_llm
from tests.engine.test_prompt_logprobs import check, reference
from tests.fixtures.tiny_models import GRANITE_MULTIPLIERS
from tests.model.helpers import assert_sampled_logprobs
from tests.lora.test_acceptance import greedy

SHAPE = dict(
    vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
)


def granite_config(**extra) -> dict:
    return {"architectures": ["GraniteForCausalLM"], "model_type": "granite", **SHAPE, **extra}


def test_multipliers_are_parsed():
    spec = ModelSpec.from_dict(granite_config(**GRANITE_MULTIPLIERS))
    assert spec.architecture == "GraniteForCausalLM"
    assert (spec.embedding_multiplier, spec.residual_multiplier, spec.logits_scaling) == (3.0, 0.5, 4.0)
    assert spec.softmax_scale == 0.6
    by_type = ModelSpec.from_dict({"model_type": "granite", **SHAPE, "attention_multiplier": 1 / 128})
    assert by_type.architecture == "GraniteForCausalLM" and by_type.softmax_scale == 1 / 128


def test_granite_defaults_follow_transformers_and_leave_llama_alone():
    from transformers import GraniteConfig

    hf = GraniteConfig()
    spec = ModelSpec.from_dict(granite_config())  # no multiplier keys at all
    assert spec.softmax_scale == hf.attention_multiplier == 1.0  # not 1/sqrt(head_dim)
    assert spec.embedding_multiplier == hf.embedding_multiplier == 1.0
    assert spec.residual_multiplier == hf.residual_multiplier == 1.0
    assert spec.logits_scaling == hf.logits_scaling == 1.0
    # transformers' Llama ignores these keys; so does loraplex
    llama = ModelSpec.from_dict({"architectures": ["LlamaForCausalLM"], **SHAPE, **GRANITE_MULTIPLIERS})
    assert llama.softmax_scale == 16**-0.5
    assert (llama.embedding_multiplier, llama.residual_multiplier, llama.logits_scaling) == (1.0, 1.0, 1.0)


@pytest.mark.parametrize(
    "key, value",
    [
        ("logits_scaling", 0),
        ("logits_scaling", 0.0),
        ("attention_multiplier", None),
        ("embedding_multiplier", math.inf),
        ("residual_multiplier", math.nan),
        ("attention_multiplier", "0.0078125"),
        ("embedding_multiplier", True),
    ],
)
def test_unhonourable_multipliers_are_refused(key, value):
    with pytest.raises(UnsupportedModelError, match=key):
        ModelSpec.from_dict(granite_config(**{key: value}))


def test_granite_moe_is_not_taken_for_granite():
    with pytest.raises(UnsupportedModelError, match="GraniteMoeForCausalLM"):
        ModelSpec.from_dict({"architectures": ["GraniteMoeForCausalLM"], "model_type": "granitemoe", **SHAPE})


@pytest.fixture(scope="module")
def hf_granite(tiny_granite_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_granite_dir, dtype=torch.float32).eval()


def test_greedy_generation_matches_transformers(tiny_granite_dir, hf_granite, loraplex_home):
    """Chunked prompts (64 tokens a step), then decodes through the paged KV cache."""
    torch.manual_seed(4)
    prompts = [torch.randint(4, 300, (n,)).tolist() for n in (3, 17, 90, 41)]
    llm = tight_llm(tiny_granite_dir, loraplex_home, num_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy(hf_granite, p, 10) for p in prompts]


def test_logprobs_and_prompt_logprobs_are_granite_logits(tiny_granite_dir, hf_granite, loraplex_home):
    """Both are the log-softmax of transformers' logits, which are divided by ``logits_scaling``
    (4 here, so logprobs of the undivided logits would be far off)."""
    torch.manual_seed(5)
    prompt = torch.randint(4, 300, (70,)).tolist()
    llm = tight_llm(tiny_granite_dir, loraplex_home, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3, prompt_logprobs=3)
    out = llm.generate(prompt, params)[0]
    check(out.prompt_logprobs, prompt, reference(hf_granite, prompt))
    assert len(out.token_ids) == 4
    assert_sampled_logprobs(hf_granite, prompt, out, 3, ordered=True)
