"""The generation config's EOS ids beyond the tokenizer's: they end a sequence as the tokenizer's
EOS does, but report their id as ``stop_reason``, since vLLM's ``update_from_generation_config``
moves them into ``stop_token_ids`` (a Llama-3-Instruct answer ending in ``<|end_of_text|>``
rather than ``<|eot_id|>`` says so); the tokenizer's own EOS reports none, and ``ignore_eos``
runs past both."""

from __future__ import annotations

import json

import pytest

from loraplex import LLM, SamplingParams
from tests.fixtures.tiny_models import make_tiny_model_dir

PROMPT = [5, 17, 42, 9, 11]
TOKENIZER_EOS = 1  # the tiny models' tokenizer's


def llm(model_dir, home) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, kv_cache_bytes=1 << 20,
               max_model_len=256)


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    """The model's greedy tokens for PROMPT, with no EOS in play, and its folder."""
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-eos"), "llama")
    out = llm(folder, tmp_path_factory.mktemp("home")).generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    return folder, out[0].outputs[0].token_ids


def test_an_extra_generation_config_eos_reports_its_id(greedy, tmp_path):
    folder, tokens = greedy
    extra = tokens[2]
    if extra in tokens[:2] or extra == TOKENIZER_EOS:
        pytest.skip("the random model repeats the token")  # keeps the expected length unambiguous
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [TOKENIZER_EOS, extra]}))
    try:
        engine = llm(folder, tmp_path)
    finally:
        (folder / "generation_config.json").unlink()
    assert engine.engine.scheduler.reported_eos_token_ids == {extra}
    stopped, ignored, listed = engine.generate(
        [{"prompt_token_ids": PROMPT}] * 3,
        [SamplingParams(temperature=0.0, max_tokens=8),
         SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
         SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[extra])])
    first = stopped.outputs[0]
    assert (first.token_ids, first.finish_reason, first.stop_reason) == (tokens[:3], "stop", extra)
    assert (ignored.outputs[0].token_ids, ignored.outputs[0].finish_reason) == (tokens, "length")
    assert (listed.outputs[0].token_ids, listed.outputs[0].stop_reason) == (tokens[:3], extra)
