"""Sampling defaults read from a generation config (vLLM's --generation-config), against
transformers' ``GenerationConfig.from_pretrained`` reading the same file, and vLLM's rules: the six
fields only (``do_sample`` ignored), the override over the file, a ceiling only when the operator
chose the value."""

from __future__ import annotations

import json

import pytest
from transformers import GenerationConfig

from loraplex.generation_defaults import GenerationConfigError, check_options, parse_override, resolve
from loraplex.sampling_params import SamplingParams

# Qwen2.5-7B-Instruct's published generation config, with a max_new_tokens added
QWEN_LIKE = dict(do_sample=True, temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05,
                 max_new_tokens=64, bos_token_id=0, eos_token_id=[1, 5], pad_token_id=2)
TAKEN = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")  # vLLM's list, less max_new_tokens


def write_config(folder, **values):
    """The file as a checkpoint ships it (written as JSON: transformers refuses to save some
    published files, such as do_sample false with a temperature)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(values))
    return folder


def reference(folder) -> dict:
    """The six fields as transformers reads them (None: not set), under SamplingParams's names."""
    hf = GenerationConfig.from_pretrained(folder)
    out = {name: getattr(hf, name) for name in TAKEN}
    out["max_tokens"] = hf.max_new_tokens
    return {k: v for k, v in out.items() if v is not None}


def test_auto_takes_the_six_fields_transformers_reads(tmp_path):
    folder = write_config(tmp_path / "model", **QWEN_LIKE, min_p=0.05)
    defaults = resolve("auto", folder)
    assert defaults.sampling_fields() == reference(folder)
    assert defaults.max_tokens_cap is None  # the model's own max_new_tokens is a default, not a ceiling
    assert defaults.sampling_params() == SamplingParams(**reference(folder))


def test_do_sample_false_does_not_make_requests_greedy(tmp_path):
    # vLLM reads only the six fields: do_sample is not one, so the temperature is still taken
    folder = write_config(tmp_path / "model", do_sample=False, temperature=0.6, top_p=0.9)
    defaults = resolve("auto", folder)
    assert reference(folder)["temperature"] == 0.6
    assert (defaults.temperature, defaults.top_p) == (0.6, 0.9)


def test_a_file_without_sampling_fields_changes_nothing(tmp_path):
    folder = write_config(tmp_path / "model", bos_token_id=1, eos_token_id=2, pad_token_id=2)
    assert reference(folder) == {}
    assert not resolve("auto", folder)
    assert resolve("auto", folder).sampling_params() == SamplingParams()
    assert not resolve("auto", tmp_path / "no-such-model")  # no file at all


def test_vllm_mode_ignores_the_file_but_not_the_override(tmp_path):
    folder = write_config(tmp_path / "model", **QWEN_LIKE)
    assert not resolve("vllm", folder)
    assert resolve("vllm", folder, '{"top_k": 5}').sampling_fields() == {"top_k": 5}


def test_the_override_wins_over_the_file_field_by_field(tmp_path):
    folder = write_config(tmp_path / "model", **QWEN_LIKE)
    defaults = resolve("auto", folder, {"temperature": 0.5, "min_p": 0.1})
    assert defaults.sampling_fields() == {**reference(folder), "temperature": 0.5, "min_p": 0.1}
    assert defaults.max_tokens_cap is None


def test_an_operator_chosen_max_new_tokens_is_also_a_ceiling(tmp_path):
    model = write_config(tmp_path / "model", **QWEN_LIKE)
    other = write_config(tmp_path / "other", do_sample=True, temperature=0.3, max_new_tokens=12)
    from_folder = resolve(str(other), model)  # a folder replaces the model's file
    assert from_folder.sampling_fields() == reference(other)
    assert from_folder.max_tokens_cap == 12 and from_folder.capped(100) == 12 and from_folder.capped(5) == 5
    assert resolve(str(other / "generation_config.json"), model).sampling_fields() == reference(other)
    overridden = resolve("auto", model, '{"max_new_tokens": 20}')
    assert (overridden.max_tokens, overridden.max_tokens_cap) == (20, 20)


def test_json_nulls_and_other_keys_in_a_file_are_not_fields(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": None, "top_k": 7, "num_beams": 4}))
    assert resolve("auto", folder).sampling_fields() == {"top_k": 7}


@pytest.mark.parametrize("override, words", [
    ("{", "not valid JSON"),
    ("[0.5]", "must be a JSON object"),
    ('{"temp": 0.5}', "unknown field(s) 'temp'"),
    ('{"do_sample": false}', "unknown field(s) 'do_sample'"),
    ('{"temperature": -1}', "temperature=-1"),
    ('{"top_p": 0}', "top_p must be in (0, 1]"),
    ('{"top_k": 2.5}', "top_k must be an integer"),
    ('{"top_p": "0.5"}', "top_p must be a number"),
    ('{"max_new_tokens": 0}', "max_new_tokens must be an integer >= 1"),
    ('{"repetition_penalty": true}', "repetition_penalty must be a number"),
])
def test_a_bad_override_is_refused_naming_the_field(override, words):
    with pytest.raises(GenerationConfigError) as err:
        parse_override(override)
    assert words in str(err.value) and "--override-generation-config" in str(err.value)


def test_a_bad_value_in_the_file_is_refused_naming_file_and_field(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "generation_config.json").write_text('{"top_p": 1.5}')
    with pytest.raises(GenerationConfigError, match=r"generation_config.json: top_p=1.5"):
        resolve("auto", folder)
    with pytest.raises(GenerationConfigError, match="top_p=1.5"):
        check_options(str(folder), None)  # a chosen folder is checked before any model loads


def test_a_folder_without_a_generation_config_is_refused(tmp_path):
    with pytest.raises(GenerationConfigError, match="no generation_config.json there"):
        check_options(str(tmp_path), None)
