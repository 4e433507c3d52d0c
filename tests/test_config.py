"""Settings carries every engine option, with the engine's default: an option added to
EngineConfig alone would be unreachable from `loraplex serve` (flags are made from Settings)."""

from __future__ import annotations

import dataclasses
import os

import pytest

from loraplex.config import EngineConfig, Settings


def test_every_engine_option_is_a_setting_with_the_same_default(monkeypatch, tmp_path):
    for name in list(os.environ):
        if name.startswith("LORAPLEX_"):
            monkeypatch.delenv(name)
    settings = Settings()
    engine_defaults = EngineConfig()
    for f in dataclasses.fields(EngineConfig):
        assert f.name in Settings.model_fields, f"EngineConfig.{f.name} has no Settings field"
        # the declared default (max_num_batched_tokens: None, which EngineConfig resolves)
        default = getattr(engine_defaults, f.name) if f.default is dataclasses.MISSING else f.default
        assert getattr(settings, f.name) == default, f.name
    assert settings.engine_config() == engine_defaults
    changed = Settings(home=tmp_path, max_loras=3, cuda_graphs=True).engine_config()
    assert (changed.home, changed.max_loras, changed.cuda_graphs) == (tmp_path, 3, True)


def test_trust_request_chat_template_is_off_unless_asked(monkeypatch):
    """vLLM's --trust-request-chat-template: the same flag on `loraplex serve`, and the env
    setting; off by default (a request's chat template is then a 400)."""
    from loraplex.cli import build_parser
    from loraplex.server.cli import settings_from_args

    monkeypatch.delenv("LORAPLEX_TRUST_REQUEST_CHAT_TEMPLATE", raising=False)
    assert Settings().trust_request_chat_template is False
    assert settings_from_args(build_parser().parse_args(["serve"])).trust_request_chat_template is False
    on = build_parser().parse_args(["serve", "--trust-request-chat-template"])
    assert settings_from_args(on).trust_request_chat_template is True
    monkeypatch.setenv("LORAPLEX_TRUST_REQUEST_CHAT_TEMPLATE", "true")
    assert Settings().trust_request_chat_template is True
    off = build_parser().parse_args(["serve", "--no-trust-request-chat-template"])
    assert settings_from_args(off).trust_request_chat_template is False  # a flag wins over the env


def test_output_parsers_are_settings_off_by_default(monkeypatch):
    """``--tool-call-parser`` / ``--reasoning-parser`` (vLLM's names): none unless asked for,
    read from the environment like every setting (the names are checked when the app starts)."""
    for name in list(os.environ):
        if name.startswith("LORAPLEX_"):
            monkeypatch.delenv(name)
    assert (Settings().tool_call_parser, Settings().reasoning_parser) == (None, None)
    monkeypatch.setenv("LORAPLEX_TOOL_CALL_PARSER", "hermes")
    monkeypatch.setenv("LORAPLEX_REASONING_PARSER", "qwen3")
    assert (Settings().tool_call_parser, Settings().reasoning_parser) == ("hermes", "qwen3")
    assert "tool_call_parser" not in EngineConfig.option_names()  # the server's, not the engine's


@pytest.mark.parametrize("given, served", [("auto", "auto"), ("float32", "float32"), ("bfloat16", "bfloat16"),
                                           ("float16", "float16"), ("half", "float16"), ("float", "float32")])
def test_engine_config_takes_vllm_dtype_names(given, served):
    # vLLM's LLM(dtype="half") / "float" are float16 / float32; the runner reads only loraplex's names
    assert EngineConfig(dtype=given).dtype == served


@pytest.mark.parametrize("field, value", [("dtype", "fp16"), ("dtype", "int8"), ("dtype", ""), ("device", "tpu"),
                                          ("device", "cuda:x"), ("device", "gpu"), ("device", "")])
def test_engine_config_refuses_unknown_dtype_and_device_names_at_once(field, value):
    # LLM(...) users got these only from the model runner, after reading the config and tokenizer
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})
