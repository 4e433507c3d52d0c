"""``loraplex serve --speculative-config JSON``: the flag reaches the engine, a method other than
ngram is refused at start, and a server running n-gram speculation answers greedy chat
completions (streamed too) exactly as one without, while /metrics counts its drafts."""

from __future__ import annotations

import json

import pytest

from loraplex.cli import build_parser
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.engine.llm_engine import LLMEngine
from loraplex.server.cli import settings_from_args, settings_or_error
from tests.engine.spec_helpers import NGRAM
from tests.server.conftest import start_server

COPY_TEXT = "alpha beta gamma delta epsilon " * 6


def serve_args(model_dir, *extra: str):
    return build_parser().parse_args(["serve", "--model", str(model_dir), *extra])


def test_bad_method_refused_at_start(tiny_llama_dir, capsys):
    args = serve_args(tiny_llama_dir, "--speculative-config",
                      '{"method": "eagle", "model": "x", "num_speculative_tokens": 3}')
    assert settings_or_error(args) is None
    assert "method 'eagle' is not supported" in capsys.readouterr().err


@pytest.fixture(scope="module")
def servers(tiny_llama_dir, tmp_path_factory):
    running = {}
    for name, extra in (("plain", ()), ("spec", ("--speculative-config", json.dumps(NGRAM)))):
        home = tmp_path_factory.mktemp(name)
        settings = settings_from_args(serve_args(tiny_llama_dir, *extra))
        config = settings.engine_config().replace(dtype="float32", device="cpu", home=home,
                                                  kv_cache_bytes=4 << 20)
        engine = AsyncLLMEngine(config, engine=LLMEngine(config))
        srv = start_server(tmp_path_factory.mktemp(name + "-srv"), engine)
        running[name] = (srv, engine, srv.make_tenant("acme"))
    assert running["spec"][1].engine.config.speculative_config == json.dumps(NGRAM)
    yield running
    for srv, engine, _ in running.values():
        srv.stop()
        engine.shutdown()


def chat(server, key: str, content: str, stream: bool = False) -> tuple[str, list]:
    model = server.app.state.ctx.served_model_name
    body = {"model": model, "max_tokens": 48, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "messages": [{"role": "user", "content": content}]}
    with server.tenant_client(key) as c:
        if not stream:
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return choice["message"]["content"], [t["token"] for t in choice["logprobs"]["content"]]
        text, tokens = "", []
        with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"]
                if delta:
                    text += delta[0]["delta"].get("content") or ""
                    tokens += [t["token"] for t in (delta[0].get("logprobs") or {}).get("content") or []]
        return text, tokens


@pytest.mark.parametrize("stream", [False, True])
def test_chat_identical_with_and_without_speculation(servers, stream):
    answers = {}
    for name, (srv, _, key) in servers.items():
        answers[name] = [chat(srv, key, f"Repeat: {COPY_TEXT} {i}", stream) for i in range(3)]
    assert answers["spec"] == answers["plain"]
    assert all(text for text, _ in answers["spec"])


def test_metrics_count_drafts(servers):
    srv, _, key = servers["spec"]
    chat(srv, key, "Repeat: " + COPY_TEXT)
    with srv.admin() as c:
        text = c.get("/metrics").text
    values = {}
    for line in text.splitlines():
        for name in ("drafts", "draft_tokens", "accepted_tokens"):
            if line.startswith(f"vllm:spec_decode_num_{name}_total{{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    assert values["drafts"] > 0 and values["draft_tokens"] >= values["drafts"], values
    assert 0 < values["accepted_tokens"] <= values["draft_tokens"], values
