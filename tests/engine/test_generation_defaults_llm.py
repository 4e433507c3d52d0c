"""``LLM`` on a tiny model whose generation_config.json sets sampling fields: the defaults it
takes (vLLM's ``get_default_sampling_params``) are the file's as transformers reads it,
``generate`` without params runs with them, ``generation_config="vllm"`` ignores the file, and a
bad override stops ``LLM(...)`` before any model is loaded."""

from __future__ import annotations

import json
import logging

import pytest
from transformers import GenerationConfig

from loraplex import LLM, SamplingParams
from loraplex.generation_defaults import GenerationConfigError
from tests.fixtures.tiny_models import make_tiny_model_dir

# greedy, so that generate() without params (no seed) is deterministic; do_sample false is
# ignored as vLLM ignores it: only the temperature says greedy
FILE = dict(do_sample=False, temperature=0.0, top_k=20, repetition_penalty=1.3, max_new_tokens=5,
            bos_token_id=0, eos_token_id=1, pad_token_id=2)
PROMPTS = ["the quick brown fox", "lorem ipsum dolor"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("tiny-genconfig"), "llama")
    (folder / "generation_config.json").write_text(json.dumps(FILE))
    return folder


def llm(model_dir, home, **options) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, kv_cache_bytes=1 << 20,
               max_model_len=256, **options)


def file_params(model_dir) -> SamplingParams:
    hf = GenerationConfig.from_pretrained(model_dir)
    return SamplingParams(temperature=hf.temperature, top_k=hf.top_k, repetition_penalty=hf.repetition_penalty,
                          max_tokens=hf.max_new_tokens)


def test_generate_without_params_runs_with_the_files_values(model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="loraplex.engine"):
        engine = llm(model_dir, tmp_path)
    started = [r.getMessage() for r in caplog.records if "default sampling parameters" in r.getMessage()]
    assert len(started) == 1 and "temperature=0.0" in started[0] and "max_tokens=5" in started[0]
    expected = file_params(model_dir)
    assert engine.get_default_sampling_params() == expected
    implicit = engine.generate(PROMPTS)
    explicit = engine.generate(PROMPTS, expected)
    assert [o.outputs[0].token_ids for o in implicit] == [o.outputs[0].token_ids for o in explicit]
    assert all(len(o.outputs[0].token_ids) == expected.max_tokens for o in implicit)  # the library's is 16
    # the repetition penalty is applied: without it, greedy decoding picks other tokens here
    plain = engine.generate(PROMPTS, SamplingParams(temperature=0.0, top_k=20, max_tokens=5))
    assert [o.outputs[0].token_ids for o in plain] != [o.outputs[0].token_ids for o in implicit]


def test_vllm_mode_and_the_override(model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="loraplex.engine"):
        plain = llm(model_dir, tmp_path, generation_config="vllm")
    assert plain.get_default_sampling_params() == SamplingParams()
    assert not [r for r in caplog.records if "default sampling parameters" in r.getMessage()]
    overridden = llm(model_dir, tmp_path, override_generation_config={"repetition_penalty": 1.0, "max_new_tokens": 3})
    expected = file_params(model_dir)
    expected.repetition_penalty, expected.max_tokens = 1.0, 3
    assert overridden.get_default_sampling_params() == expected


def test_a_bad_override_stops_llm_before_the_model_loads(tmp_path):
    with pytest.raises(GenerationConfigError, match="top_p=2"):
        LLM(model=str(tmp_path / "no-such-model"), home=tmp_path, override_generation_config='{"top_p": 2}')


def test_a_bad_value_in_the_models_file_stops_llm(model_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for path in model_dir.iterdir():
        (broken / path.name).symlink_to(path)
    (broken / "generation_config.json").unlink()
    (broken / "generation_config.json").write_text(json.dumps({**FILE, "top_k": "20"}))
    with pytest.raises(GenerationConfigError, match="top_k must be an integer"):
        llm(broken, tmp_path)
