"""``--reasoning-parser`` refuses, at start, a tokenizer without ``<think>`` and ``</think>`` as
single tokens, as vLLM's thinking parsers do (BaseThinkingReasoningParser looks each tag up in the
vocabulary and raises "could not locate think start/end tokens in the tokenizer"): structured
output after reasoning finds the boundary by those tokens. The reference is the tokenizer's own
vocabulary, as vLLM reads it."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from loraplex.config import Settings
from loraplex.server.app import create_app
from loraplex.server.reasoning_parsers import REASONING_PARSERS
from tests.engine.reasoning_helpers import END_THINK, THINK, thinking_tokenizer
from tests.fixtures.tiny_models import make_tiny_tokenizer
from tests.server.fakes import FakeEngine


def vllm_would_start(tokenizer) -> bool:
    """vLLM's rule: both tags are entries of the vocabulary."""
    vocab = tokenizer.get_vocab()
    return THINK in vocab and END_THINK in vocab


@pytest.mark.parametrize("name", list(REASONING_PARSERS))
def test_a_tokenizer_with_the_tags_as_tokens_is_taken(name):
    tok = thinking_tokenizer()
    assert vllm_would_start(tok)
    REASONING_PARSERS[name].check_tokenizer(tok)  # no error


@pytest.mark.parametrize("name", list(REASONING_PARSERS))
def test_a_tokenizer_that_spells_the_tags_in_pieces_is_refused(name):
    tok = make_tiny_tokenizer()  # byte-level: "<think>" is 7 tokens
    assert not vllm_would_start(tok)
    pieces = len(tok("<think>", add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError) as caught:
        REASONING_PARSERS[name].check_tokenizer(tok)
    message = str(caught.value)
    assert message.startswith(f"--reasoning-parser {name}: <think> is not one token")
    assert f"encodes as {pieces} tokens" in message and "leave --reasoning-parser out" in message


def test_one_tag_missing_is_enough_to_refuse():
    tok = make_tiny_tokenizer(318)
    tok.add_tokens([THINK])  # </think> still in pieces
    assert not vllm_would_start(tok)
    with pytest.raises(ValueError, match="</think> is not one token"):
        REASONING_PARSERS["qwen3"].check_tokenizer(tok)


def test_the_server_does_not_start_on_such_a_tokenizer(tmp_path):
    engine = FakeEngine()
    engine.tokenizer = make_tiny_tokenizer()
    app = create_app(Settings(home=tmp_path, reasoning_parser="deepseek_r1"), engine=engine,
                     registry=object(), adapters=object())
    with pytest.raises(ValueError, match="--reasoning-parser deepseek_r1: <think> is not one token"):
        with TestClient(app):
            pass
    assert not app.state.ctx.lifecycle.started
