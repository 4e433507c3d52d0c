"""Client side of the chaos test (test_chaos_e2e.py): a seeded plan of tenant requests (good ones,
bad ones, streams cut short, answers abandoned), an asyncio runner, and checks of OpenAI response
and SSE shapes. Server-side reads (idle state, the access log, trouble in the log) come from
benchmarks/serving_server.py, as bench_serving uses them.

Greedy requests that can be checked exactly put ``logit_bias`` +100 on the 26 lowercase letters
(the tiny tokenizer has one token per byte: id = 4 + byte), so every token is one character and
the expected text of any ``max_tokens``/``stop`` follows from one reference of ``MAX_REF`` tokens.
"""

from __future__ import annotations

import asyncio
import importlib
import json
import random
import re
import sys
from dataclasses import dataclass, field

import httpx

from tests.e2e.compat_server import LETTERS
from tests.e2e.server_process import REPO_ROOT

PROMPTS = ("tell me a story", "SELECT * FROM users", "hello there", "one two three")
MAX_REF = 20  # tokens of a reference; checked requests ask for at most this many
STOPS = (None, None, "e", ["q", "z"], "th")
FINISHES = ("stop", "length")


def serving_server():
    """benchmarks/serving_server.py (idle_state, access_records, server_problems, parse_metrics)."""
    path = str(REPO_ROOT / "benchmarks")
    if path not in sys.path:
        sys.path.insert(0, path)
    return importlib.import_module("serving_server")


@dataclass
class Planned:
    idx: int
    key: str  # which API key: a tenant's name, or "bogus"
    path: str
    body: dict | None = None
    raw: bytes | None = None  # sent as is instead of ``body``
    mode: str = "full"  # "full", "cut" (stream closed after cut_after lines), "abandon" (client gives up)
    cut_after: int = 0
    expect: int | None = None  # a bad request: the status it must get
    may_404: bool = False  # a version deleted, or not yet uploaded, while traffic runs
    compare: tuple | None = None  # (kind, prompt, candidate "tenant:model@N" refs)

    @property
    def kind(self) -> str:
        return "chat" if self.path.endswith("chat/completions") else "completion"

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and self.body.get("stream") is True

    @property
    def n_choices(self) -> int:
        return (self.body or {}).get("n") or 1


@dataclass
class Outcome:
    status: int | None = None
    problems: list[str] = field(default_factory=list)
    texts: list[str] | None = None
    finishes: list[str | None] | None = None
    done: bool = False  # a whole success: JSON 200, or a stream read to [DONE]
    cut: bool = False
    abandoned: bool = False


# --- the plan ----------------------------------------------------------------------------------


def _body(kind: str, model: str, prompt: str, **kw) -> dict:
    if kind == "chat":
        return {"model": model, "messages": [{"role": "user", "content": prompt}], **kw}
    return {"model": model, "prompt": prompt, **kw}


def _bad(rng: random.Random, tenant: str, kind: str, limits: dict) -> Planned:
    """A request that must be refused, with the status it must get."""
    ep = "chat/completions" if kind == "chat" else "completions"
    path, key = f"/t/{tenant}/v1/{ep}", tenant
    foreign = "solo" if tenant == "alpha" else "swap"
    stream = {"stream": True} if rng.random() < 0.5 else {}
    cases = [
        (400, None, b'{"model": "base-model", "prompt": "cut off'),
        (400, _body(kind, "base-model", "x", max_tokens="ten"), None),
        (400, {"model": "base-model", "messages": "hi"} if kind == "chat" else {"model": "base-model", "prompt": {}}, None),
        (400, _body(kind, "base-model", "x", temperature="hot", **stream), None),
        (404, _body(kind, "nope", "x", **stream), None),
        (404, _body(kind, "swap@99", "x"), None),
        (404, _body(kind, foreign, "x", **stream), None),
        (401, _body(kind, "base-model", "x"), None),  # unknown key
        (401, _body(kind, "base-model", "x"), None),  # a key of another tenant
        (400, _body(kind, "base-model", "x", max_tokens=limits["max_model_len"], **stream), None),
        (400, _body(kind, "base-model", "a" * (limits["max_model_len"] + 5)), None),
        (413, _body(kind, "base-model", "a" * (limits["max_body_bytes"] + 10)), None),
        (400, _body(kind, "base-model", "x", logit_bias={"5": 150}, **stream), None),
        (400, _body(kind, "base-model", "x", logit_bias={"100000": 1}), None),
        (400, _body(kind, "base-model", "x", logit_bias={"abc": 1}), None),
        (400, _body(kind, "base-model", "x", n=limits["max_n"] + 1), None),
    ]
    case = rng.randrange(len(cases))
    status, body, raw = cases[case]
    if case == 7:
        key = "bogus"
    elif case == 8:
        path = f"/t/{'beta' if tenant != 'beta' else 'alpha'}/v1/{ep}"
    return Planned(0, key, path, body=body, raw=raw, expect=status)


def _good(rng: random.Random, tenant: str, kind: str, models: dict) -> Planned:
    model, candidates = rng.choice(models[tenant])
    prompt = rng.choice(PROMPTS)
    ep = "chat/completions" if kind == "chat" else "completions"
    path = f"/t/{tenant}/v1/{ep}" if rng.random() < 0.6 else f"/v1/{ep}"
    kw: dict = {"n": rng.choice((1, 1, 1, 2, 3)), "max_tokens": rng.choice((4, 8, 12, MAX_REF))}
    stop = rng.choice(STOPS)
    if stop is not None:
        kw["stop"] = stop
    checked = rng.random() < 0.7
    if checked:
        kw.update(temperature=0, logit_bias=LETTERS)
        if kind == "completion" and rng.random() < 0.2:
            del kw["max_tokens"]  # OpenAI's default, 16
    else:  # sampled: any bytes, multi-byte characters held back, EOS, logprobs
        kw.update(temperature=1.0, seed=rng.randrange(1000), ignore_eos=rng.random() < 0.3)
        if rng.random() < 0.3:
            kw.update({"logprobs": 2} if kind == "completion" else {"logprobs": True, "top_logprobs": 2})
    mode = rng.choices(("full", "cut", "abandon"), (0.72, 0.2, 0.08))[0]
    stream = mode == "cut" or rng.random() < 0.5
    if stream:
        kw["stream"] = True
        if rng.random() < 0.5:
            kw["stream_options"] = {"include_usage": True}
    p = Planned(0, tenant, path, body=_body(kind, model, prompt, **kw), mode=mode, cut_after=rng.randint(1, 6))
    p.may_404 = model in ("swap@3", "swap@4")
    if checked:
        p.compare = (kind, prompt, candidates)
    return p


def make_plan(seed: int, users: int, per_user: int, models: dict, limits: dict) -> list[list[Planned]]:
    """``users`` lists of ``per_user`` requests. ``models``: tenant -> [(model, candidates)]."""
    rng = random.Random(seed)
    plan, idx = [], 0
    for u in range(users):
        tenant = ("alpha",) * 6 + ("beta",) * 3 + ("gamma",)
        tenant = tenant[u % 10]
        mine = []
        for _ in range(per_user):
            kind = rng.choice(("chat", "completion"))
            p = _bad(rng, tenant, kind, limits) if rng.random() < 0.15 else _good(rng, tenant, kind, models)
            p.idx, idx = idx, idx + 1
            mine.append(p)
        plan.append(mine)
    return plan


# --- running and checking --------------------------------------------------------------------


async def run_one(client: httpx.AsyncClient, p: Planned, keys: dict) -> Outcome:
    headers = {"Authorization": f"Bearer {keys[p.key]}"}
    if p.raw is not None:
        kwargs = {"content": p.raw, "headers": {**headers, "content-type": "application/json"}}
    else:
        kwargs = {"json": p.body, "headers": headers}
    try:
        if p.mode == "abandon":
            try:  # the client hangs up while the server works (cancelling closes the connection)
                call = _stream(client, p, kwargs) if p.stream else client.post(p.path, **kwargs)
                got = await asyncio.wait_for(call, timeout=0.05 + 0.3 * (p.idx % 4))
            except asyncio.TimeoutError:
                return Outcome(abandoned=True)
            return got if p.stream else check_plain(p, got.status_code, got.content)
        if p.stream and p.expect is None:
            return await _stream(client, p, kwargs)
        r = await client.post(p.path, **kwargs)
        return check_plain(p, r.status_code, r.content)
    except httpx.HTTPError as exc:
        return Outcome(problems=[f"transport error: {exc!r}"])


async def _stream(client: httpx.AsyncClient, p: Planned, kwargs: dict) -> Outcome:
    async with client.stream("POST", p.path, **kwargs) as resp:
        if resp.status_code != 200:
            return check_plain(p, resp.status_code, await resp.aread())
        lines = []
        async for line in resp.aiter_lines():
            if line:
                lines.append(line)
                if p.mode == "cut" and len(lines) >= p.cut_after:
                    break  # leaving the block closes the connection mid-stream
    return check_stream(p, lines, complete=p.mode != "cut" or lines[-1:] == ["data: [DONE]"])


def check_error(status: int, content: bytes) -> list[str]:
    try:
        err = json.loads(content)["error"]
        ok = isinstance(err["message"], str) and isinstance(err["type"], str) and "param" in err and "code" in err
    except (ValueError, KeyError, TypeError):
        ok = False
    return [] if ok else [f"{status}: not an OpenAI error envelope: {content[:200]!r}"]


def check_plain(p: Planned, status: int, content: bytes) -> Outcome:
    out = Outcome(status=status)
    if status != 200:
        out.problems += check_error(status, content)
        allowed = {p.expect} if p.expect is not None else {429} | ({404} if p.may_404 else set())
        if status not in allowed:
            out.problems.append(f"status {status}, expected {sorted(allowed)}: {content[:200]!r}")
        return out
    if p.expect is not None:
        out.problems.append(f"bad request accepted (expected {p.expect})")
        return out
    try:
        body = json.loads(content)
    except ValueError:
        out.problems.append(f"200 with a body that is not JSON: {content[:200]!r}")
        return out
    want_obj, want_id = ("chat.completion", "chatcmpl-") if p.kind == "chat" else ("text_completion", "cmpl-")
    if body.get("object") != want_obj or not str(body.get("id", "")).startswith(want_id):
        out.problems.append(f"object/id: {body.get('object')} {body.get('id')}")
    if body.get("model") != p.body["model"]:
        out.problems.append(f"model {body.get('model')!r} != {p.body['model']!r}")
    choices = body.get("choices") or []
    if [c.get("index") for c in choices] != list(range(p.n_choices)):
        out.problems.append(f"choice indices {[c.get('index') for c in choices]}")
    out.texts = [(c.get("message") or {}).get("content") if p.kind == "chat" else c.get("text") for c in choices]
    out.finishes = [c.get("finish_reason") for c in choices]
    if not all(isinstance(t, str) for t in out.texts) or not all(f in FINISHES for f in out.finishes):
        out.problems.append(f"texts/finish reasons: {out.texts} {out.finishes}")
    u = body.get("usage") or {}
    if u.get("total_tokens") != (u.get("prompt_tokens") or 0) + (u.get("completion_tokens") or -1):
        out.problems.append(f"usage {u}")
    out.done = not out.problems
    return out


def check_stream(p: Planned, lines: list[str], complete: bool) -> Outcome:
    out = Outcome(status=200, cut=not complete)
    n = p.n_choices
    texts, finishes, ids, usage_seen = [""] * n, [[] for _ in range(n)], set(), False
    want_obj = "chat.completion.chunk" if p.kind == "chat" else "text_completion"
    for i, line in enumerate(lines):
        if line == "data: [DONE]":
            if i != len(lines) - 1:
                out.problems.append("data after [DONE]")
            continue
        try:
            assert line.startswith("data: ")
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            assert chunk["object"] == want_obj and chunk["model"] == p.body["model"], chunk
            ids.add(chunk["id"])
            if not chunk["choices"]:  # the usage chunk
                assert chunk["usage"]["total_tokens"] == chunk["usage"]["prompt_tokens"] + chunk["usage"]["completion_tokens"]
                usage_seen = True
            for c in chunk["choices"]:
                assert 0 <= c["index"] < n and c["finish_reason"] in (None, *FINISHES), c
                texts[c["index"]] += (c["delta"].get("content") or "") if p.kind == "chat" else c["text"]
                if c["finish_reason"]:
                    finishes[c["index"]].append(c["finish_reason"])
        except (AssertionError, ValueError, KeyError, TypeError, AttributeError) as exc:
            out.problems.append(f"bad chunk {line[:200]!r}: {exc!r}")
    if len(ids) > 1:
        out.problems.append(f"chunks with {len(ids)} ids")
    out.texts = texts
    if complete:
        if lines[-1:] != ["data: [DONE]"]:
            out.problems.append(f"stream ended without [DONE]: {lines[-2:]}")
        if any(len(f) != 1 for f in finishes):
            out.problems.append(f"finish reasons per choice: {finishes}")
        if usage_seen != bool((p.body.get("stream_options") or {}).get("include_usage")):
            out.problems.append(f"usage chunk seen: {usage_seen}")
        out.finishes = [f[0] if f else None for f in finishes]
        out.done = not out.problems
    return out


def expected(ref: str, max_tokens: int, stop) -> tuple[str, str]:
    """Text and finish reason of a greedy letters-only request, from its reference text."""
    text = ref[:max_tokens]
    best = None  # the stop string completed first ends the text, which leaves it out
    for s in [stop] if isinstance(stop, str) else stop or []:
        at = text.find(s)
        if at >= 0 and (best is None or at + len(s) < best[0]):
            best = (at + len(s), at)
    return (text[: best[1]], "stop") if best else (text, "length")


_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')


def metric_samples(text: str) -> list[tuple[str, dict, float]]:
    """Prometheus text -> (name, labels, value) per sample (label values without escapes)."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and not line.startswith("#"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
            out.append((m.group(1), labels, float(m.group(3))))
    return out
