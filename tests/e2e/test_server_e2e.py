"""End to end: the real ``loraplex serve`` process, a tiny random Llama, PEFT adapters uploaded over
HTTP, called through the official openai client, checked against the offline engine.

One server serves the whole module (its start costs most of the time); tests use their own
tenants and adapters where they change state. The SIGTERM drain test stops it, so it runs last.
"""

from __future__ import annotations

import io
import json
import signal
import socket
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from loraplex.sampling_params import SamplingParams
from tests.e2e.server_process import ServerProcess, start_server
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.fixtures.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 512
KV_BYTES = 8 << 20
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class World:
    srv: ServerProcess
    model_dir: Path
    adapters: dict[str, Path]
    acme: str  # API keys
    globex: str
    acme_client: openai.OpenAI


def _files(path: Path) -> dict:
    return {
        name: (name, (path / name).read_bytes(), "application/octet-stream")
        for name in ("adapter_config.json", "adapter_model.safetensors")
    }


def _archive(path: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            tar.add(path / name, arcname=f"adapter/{name}")
    return buf.getvalue()


def _upload(srv: ServerProcess, tenant: str, name: str, path: Path, archive: bool = False) -> dict:
    files = {"archive": ("adapter.tar.gz", _archive(path), "application/gzip")} if archive else _files(path)
    with srv.admin() as c:
        r = c.post(f"/admin/v1/tenants/{tenant}/adapters/{name}/versions", files=files)
    assert r.status_code == 201, r.text
    return r.json()


def _tenant(srv: ServerProcess, name: str) -> str:
    with srv.admin() as c:
        assert c.post("/admin/v1/tenants", json={"name": name}).status_code == 201
        r = c.post(f"/admin/v1/tenants/{name}/keys")
    assert r.status_code == 201
    return r.json()["key"]


def _engine_stats(srv: ServerProcess) -> dict:
    with srv.admin() as c:
        return c.get("/admin/v1/status").json()["engine"]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("e2e")
    model_dir = make_tiny_model_dir(root / "model", "llama", seed=7)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    adapters = {
        "a0": make_peft_adapter(base, root / "adapters" / "a0", seed=10),
        "a1": make_peft_adapter(base, root / "adapters" / "a1", seed=11, target_modules=ALL_TARGETS),
        "a2": make_peft_adapter(base, root / "adapters" / "a2", seed=12, r=8),
    }
    srv = start_server(
        root / "home", model_dir, "--kv-cache-bytes", str(KV_BYTES), "--max-model-len", str(MAX_MODEL_LEN),
        "--max-body-bytes", str(2 << 20), "--shutdown-grace-seconds", "60",
    )
    try:
        acme, globex = _tenant(srv, "acme"), _tenant(srv, "globex")
        v1 = _upload(srv, "acme", "sql", adapters["a0"])
        v2 = _upload(srv, "acme", "sql", adapters["a1"], archive=True)
        assert (v1["version"], v2["version"]) == (1, 2)
        _upload(srv, "globex", "private", adapters["a2"])
        client = openai.OpenAI(base_url=f"{srv.url}/t/acme/v1", api_key=acme, max_retries=0, timeout=120)
        yield World(srv, model_dir, adapters, acme, globex, client)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def offline(world):
    from loraplex import LLM

    llm = LLM(model=str(world.model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN, kv_cache_bytes=KV_BYTES)
    for name, path in world.adapters.items():
        llm.add_adapter(name, str(path))
    return llm


def _offline_text(llm, prompt, adapter, **params) -> str:
    return llm.generate(prompt, SamplingParams(**params), adapters=[adapter])[0].text


def test_completions_equal_offline_engine(world, offline):
    client = world.acme_client
    for prompt, seed, temperature in (("The quick brown fox", None, 0.0), ("SELECT * FROM", 42, 1.0)):
        got = client.completions.create(model="sql", prompt=prompt, max_tokens=24, temperature=temperature, seed=seed)
        want = offline.generate(prompt, SamplingParams(max_tokens=24, temperature=temperature, seed=seed), adapters=["a0"])[0]
        assert got.choices[0].text == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
        assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    base = client.completions.create(model="base-model", prompt="hello", max_tokens=16, temperature=0)
    assert base.choices[0].text == _offline_text(offline, "hello", None, max_tokens=16, temperature=0)
    scored = client.completions.create(model="sql", prompt="hello", max_tokens=6, temperature=0, logprobs=3)
    lp = scored.choices[0].logprobs
    # keyed by token text as OpenAI does: byte tokens that decode alike share a key
    assert len(lp.token_logprobs) == 6 and all(1 <= len(t) <= 3 for t in lp.top_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(abs(max(top.values()) - chosen) < 1e-4 for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    assert "".join(lp.tokens) == scored.choices[0].text
    pinned = client.completions.create(model="sql@2", prompt="hello", max_tokens=16, temperature=0)
    assert pinned.choices[0].text == _offline_text(offline, "hello", "a1", max_tokens=16, temperature=0)
    assert pinned.choices[0].text != _offline_text(offline, "hello", "a0", max_tokens=16, temperature=0)


def test_chat_and_streaming_with_usage(world, offline):
    client = world.acme_client
    messages = [{"role": "system", "content": "You write SQL."}, {"role": "user", "content": "count rows"}]
    ids = offline.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    want = offline.generate(ids, SamplingParams(max_tokens=20, temperature=0), adapters=["a0"])[0].text
    got = client.chat.completions.create(model="sql", messages=messages, max_completion_tokens=20, temperature=0)
    assert got.choices[0].message.content == want
    assert got.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == got.usage.completion_tokens
    scored = client.chat.completions.create(model="sql", messages=messages, max_tokens=5, temperature=0,
                                            logprobs=True, top_logprobs=3)
    content = scored.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 3 for c in content)
    assert all(abs(c.top_logprobs[0].logprob - c.logprob) < 1e-4 for c in content)
    cstream = client.completions.create(model="sql", prompt="abc", max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in cstream) == _offline_text(offline, "abc", "a0", max_tokens=12, temperature=0)


def _stream_lines(client: httpx.Client, path: str, body: dict):
    """Open an SSE request; returns (response context, line iterator)."""
    ctx = client.stream("POST", path, json=body)
    resp = ctx.__enter__()
    assert resp.status_code == 200
    return ctx, (line for line in resp.iter_lines() if line)


def _read_stream(lines) -> tuple[str, list[str]]:
    text, finishes = "", []
    for line in lines:
        assert line.startswith("data: ")
        if line == "data: [DONE]":
            return text, finishes
        obj = json.loads(line[6:])
        assert "error" not in obj, obj
        for choice in obj["choices"]:
            text += choice.get("text") or choice.get("delta", {}).get("content") or ""
            if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
    raise AssertionError("stream ended without [DONE]")


def test_hot_swap_during_stream(world, offline):
    key = _tenant(world.srv, "swapper")
    _upload(world.srv, "swapper", "m", world.adapters["a0"])
    _upload(world.srv, "swapper", "m", world.adapters["a1"])
    params = dict(max_tokens=200, temperature=0, ignore_eos=True)
    with world.srv.client(key) as c, world.srv.admin() as admin:
        ctx, lines = _stream_lines(c, "/v1/completions", {"model": "m", "prompt": "swap", "stream": True, **params})
        first = next(lines)
        assert admin.put("/admin/v1/tenants/swapper/adapters/m/active", json={"version": 2}).status_code == 200
        assert _engine_stats(world.srv)["num_requests_running"] >= 1  # the old stream is still running
        after = c.post("/v1/completions", json={"model": "m", "prompt": "swap", "max_tokens": 16, "temperature": 0})
        text, finishes = _read_stream(_chain([first], lines))
        ctx.__exit__(None, None, None)
    assert after.json()["choices"][0]["text"] == _offline_text(offline, "swap", "a1", max_tokens=16, temperature=0)
    assert text == _offline_text(offline, "swap", "a0", **params)  # all of it on the old version
    assert finishes == ["length"]


def _chain(head, tail):
    yield from head
    yield from tail


def test_delete_while_in_use(world, offline):
    key = _tenant(world.srv, "deleter")
    _upload(world.srv, "deleter", "gone", world.adapters["a2"])
    params = dict(max_tokens=150, temperature=0, ignore_eos=True)
    with world.srv.client(key) as c, world.srv.admin() as admin:
        ctx, lines = _stream_lines(c, "/v1/completions", {"model": "gone", "prompt": "bye", "stream": True, **params})
        first = next(lines)
        assert admin.delete("/admin/v1/tenants/deleter/adapters/gone").status_code == 200
        refused = c.post("/v1/completions", json={"model": "gone", "prompt": "bye", "max_tokens": 2})
        text, finishes = _read_stream(_chain([first], lines))
        ctx.__exit__(None, None, None)
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"
    assert text == _offline_text(offline, "bye", "a2", **params) and finishes == ["length"]


def test_tenant_isolation_and_errors(world):
    srv = world.srv
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        body = {"model": "sql", "prompt": "x", "max_tokens": 2}
        assert c.post("/t/acme/v1/completions", json=body).status_code == 401
        r = c.post("/t/acme/v1/completions", json=body, headers={"Authorization": f"Bearer {world.globex}"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with srv.client(world.acme) as c:
        foreign = c.post("/v1/completions", json={"model": "private", "prompt": "x"})
        missing = c.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        for r in (foreign, missing):
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert foreign.json()["error"]["message"].replace("private", "?") == missing.json()["error"]["message"].replace("nope", "?")
        bad = c.post("/v1/completions", json={"model": "sql", "prompt": "x", "temperature": "hot"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        long = c.post("/v1/completions", json={"model": "sql", "prompt": "a" * 600})
        assert long.status_code == 400 and long.json()["error"]["code"] == "context_length_exceeded"
        over = c.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": MAX_MODEL_LEN})
        assert over.status_code == 400 and over.json()["error"]["param"] == "max_tokens"
        huge = c.post("/v1/completions", json={"model": "sql", "prompt": "a" * (3 << 20)})
        assert huge.status_code == 413
    other = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=world.globex, max_retries=0)
    assert sorted(m.id for m in other.models.list()) == ["base-model", "private"]
    with pytest.raises(openai.NotFoundError):
        other.completions.create(model="sql", prompt="x", max_tokens=1)


def test_admin_upload_refusals_and_tiers(world):
    srv = world.srv
    good = world.adapters["a0"]
    with srv.admin() as c:
        base = "/admin/v1/tenants/globex/adapters/bad/versions"
        garbage = {"adapter_config.json": ("adapter_config.json", (good / "adapter_config.json").read_bytes()),
                   "adapter_model.safetensors": ("adapter_model.safetensors", b"not safetensors")}
        r = c.post(base, files=garbage)
        assert r.status_code == 400 and r.json()["error"]["message"]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            tar.add(good / "adapter_config.json", arcname="../adapter_config.json")
        r = c.post(base, files={"archive": ("evil.tar.gz", buf.getvalue(), "application/gzip")})
        assert r.status_code == 400 and r.json()["error"]["param"] == "archive"
        assert c.get("/admin/v1/tenants/globex/adapters/bad").status_code == 404  # nothing was stored

        one = "/admin/v1/tenants/globex/adapters/private"
        assert c.post(one + "/load", json={"tier": "device", "pin": True}).status_code == 200
        info = c.get(one).json()
        assert info["tier"] == "device" and info["pinned"] is True
        assert c.post(one + "/unload").json()["unloaded"] == [1]
        assert c.get(one).json()["tier"] in ("disk", "store")
        status = c.get("/admin/v1/status").json()
        assert status["ready"] is True and status["model"] == "base-model"


def test_disconnect_aborts_and_frees_blocks(world):
    stats = _engine_stats(world.srv)
    total = stats["num_blocks_total"]
    assert stats["num_blocks_free"] == total
    host, port = world.srv.url.removeprefix("http://").split(":")
    body = json.dumps({"model": "sql", "prompt": "go", "max_tokens": 450, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {world.acme}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )
    seen = b""
    while seen.count(b"data: ") < 3:
        seen += sock.recv(65536)
    assert _engine_stats(world.srv)["num_blocks_free"] < total
    sock.close()
    closed_at = time.monotonic()
    while _engine_stats(world.srv)["num_blocks_free"] != total:
        assert time.monotonic() - closed_at < 1.0, "blocks not freed within a second"
        time.sleep(0.02)
    assert _engine_stats(world.srv)["num_requests_running"] == 0


def _metric(text: str, name: str) -> float:
    (line,) = [line for line in text.splitlines() if line.startswith(name + "{") or line.startswith(name + " ")]
    return float(line.rsplit(" ", 1)[1])


def test_metrics_and_access_log(world):
    for stream in (False, True):
        list(world.acme_client.completions.create(model="sql", prompt="m", max_tokens=3, stream=stream) or [])
    text = httpx.get(world.srv.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:lora_requests_info", "vllm:time_to_first_token_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", 'loraplex_adapters{tier="device"}',
                 "loraplex_adapter_loads_total", 'loraplex_adapter_requests_total{adapter="acme/sql"}',
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"):
        assert name in text, name
    # the same 40-byte prompt twice: the second request finds its first two 16-token blocks cached
    hits_before = _metric(text, "vllm:prefix_cache_hits_total")
    queries_before = _metric(text, "vllm:prefix_cache_queries_total")
    for _ in range(2):
        world.acme_client.completions.create(model="sql", prompt="cache me, please: " + "x" * 22, max_tokens=1)
    text = httpx.get(world.srv.url + "/metrics").text
    assert _metric(text, "vllm:prefix_cache_hits_total") - hits_before >= 32
    assert _metric(text, "vllm:prefix_cache_queries_total") - queries_before >= 80
    log = world.srv.log()
    records = [json.loads(line) for line in log.splitlines() if line.startswith('{"event":"request"')]
    assert records and all({"tenant", "adapter", "version", "prompt_tokens", "completion_tokens", "ttft_s",
                            "duration_s", "status"} <= set(r) for r in records)
    assert any(r["tenant"] == "acme" and r["adapter"] == "sql" and r["status"] == 200 for r in records)
    for secret in (world.acme, world.globex, "e2e-admin-key"):
        assert secret not in log


@pytest.mark.timeout(300)
def test_load_200_streams_over_20_adapters(world, tmp_path):
    """200 concurrent streaming requests over 20 adapters: no errors, every stream complete, no
    KV block leaked."""
    import asyncio

    from transformers import AutoModelForCausalLM

    srv = world.srv
    key = _tenant(srv, "load")
    base = AutoModelForCausalLM.from_pretrained(world.model_dir)
    for i in range(20):
        path = make_peft_adapter(base, tmp_path / f"l{i}", seed=100 + i, r=4 + 4 * (i % 3))
        _upload(srv, "load", f"l{i}", path)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, str | None, int]:
        body = {"model": f"l{i % 20}", "prompt": f"request number {i}", "max_tokens": 12, "ignore_eos": True,
                "temperature": 0.7, "seed": i, "stream": True, "stream_options": {"include_usage": True}}
        finish, usage, done = None, 0, False
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line:
                    continue
                if line == "data: [DONE]":
                    done = True
                    continue
                obj = json.loads(line[6:])
                assert "error" not in obj, obj
                if obj.get("usage"):
                    usage = obj["usage"]["completion_tokens"]
                for c in obj["choices"]:
                    finish = c["finish_reason"] or finish
        return int(done), finish, usage

    async def run_all():
        limits = httpx.Limits(max_connections=250, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=srv.url, headers={"Authorization": f"Bearer {key}"},
                                     timeout=240, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(200)))

    start = time.monotonic()
    results = asyncio.run(run_all())
    assert time.monotonic() - start < 240
    assert results == [(1, "length", 12)] * 200
    stats = _engine_stats(srv)
    assert stats["num_blocks_free"] == stats["num_blocks_total"]
    assert stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0


def test_sigterm_drains_in_flight_streams(world, offline):
    """Runs last: stops the module's server."""
    srv = world.srv
    params = dict(max_tokens=150, temperature=0, ignore_eos=True)
    with srv.client(world.acme) as c:
        ctx, lines = _stream_lines(c, "/v1/completions", {"model": "sql", "prompt": "drain", "stream": True, **params})
        first = next(lines)
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(srv.url + "/ready").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = c.post("/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2})
        text, finishes = _read_stream(_chain([first], lines))
        ctx.__exit__(None, None, None)
    assert refused.status_code == 503
    assert text == _offline_text(offline, "drain", "a0", **params) and finishes == ["length"]
    assert srv.proc.wait(timeout=30) == 0
