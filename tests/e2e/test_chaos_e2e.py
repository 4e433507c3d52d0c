"""Chaos under load, what an operator moving from vLLM or LoRAX would run before switching: one real
``loraplex serve`` (tiny random Llama, tiny peft adapters), 150 concurrent asyncio clients over three
tenants sending a seeded mix (chat and completions, streams cut at random points, answers given
up on, n > 1, stop strings, max_tokens, adapters by name and name@N, the base model, and bad
requests of every kind) while an operator hot-swaps, uploads, deletes a version, loads, pins and
unloads. Then: no 5xx and every answer well-formed; pinned (and by-name) greedy outputs equal to
references on the idle server; idle and clean within seconds (no request, no KV block held, no
tenant slot, no staging file); Prometheus counters agree with what was sent and with the access
log; no traceback in the server's log.

The chaos runs once (module fixture); the tests read its record.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.e2e.chaos_traffic import LETTERS, MAX_REF, PROMPTS, Outcome, expected, make_plan, metric_samples, run_one
from tests.e2e.chaos_traffic import serving_server as _serving_server
from tests.e2e.server_process import ADMIN_KEY, ServerProcess, start_server
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.fixtures.tiny_models import make_tiny_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

SEED = int(os.environ.get("CHAOS_SEED", "20261203"))  # another mix: CHAOS_SEED=... pytest ...
USERS, PER_USER = 150, 8
LIMITS = {"max_model_len": 256, "max_body_bytes": 256 << 10, "max_n": 16}
TENANT_LIMIT = 80  # concurrent requests per tenant: alpha's 90 users meet it
TENANT_ROUTES = ("completions", "chat_completions", "unmatched")  # unmatched: 413 before routing
ss = _serving_server()

SWAP = ("alpha:swap@1", "alpha:swap@2")
MODELS = {
    "alpha": [("base-model", ("base",)), ("swap", SWAP), ("swap@1", SWAP[:1]), ("swap@2", SWAP[1:]),
              ("swap@3", ("alpha:swap@3",)), ("swap@4", ("alpha:swap@4",)), ("pinme", ("alpha:pinme@1",)),
              ("pinme@1", ("alpha:pinme@1",))],
    "beta": [("base-model", ("base",)), ("solo", ("beta:solo@1",)), ("solo@1", ("beta:solo@1",))],
    "gamma": [("base-model", ("base",))],
}


@dataclass
class Chaos:
    srv: ServerProcess
    home: Path
    keys: dict
    plan: list
    outcomes: list[Outcome]
    admin_log: list = field(default_factory=list)  # (op, status, body, time done)
    shas: dict = field(default_factory=dict)  # "swap@3" -> content hash
    refs: dict = field(default_factory=dict)  # ("chat"|"completion", prompt, "tenant:model") -> text
    idle: dict = field(default_factory=dict)
    status: dict = field(default_factory=dict)  # /admin/v1/status once idle
    metrics_before: list = field(default_factory=list)
    metrics_after: list = field(default_factory=list)
    records: list = field(default_factory=list)  # access-log lines of the chaos
    traffic_s: float = 0.0
    traffic_done_at: float = 0.0


def _files(path: Path) -> dict:
    return {n: (n, (path / n).read_bytes(), "application/octet-stream")
            for n in ("adapter_config.json", "adapter_model.safetensors")}


async def _references(srv: ServerProcess, keys: dict, wanted: list[tuple]) -> dict:
    """Greedy letters-only answers of MAX_REF tokens, one request each, all at once."""
    async def one(client, kind, prompt, ref):
        tenant, model = ref.split(":") if ":" in ref else ("alpha", "base-model")
        body = {"model": model, "max_tokens": MAX_REF, "temperature": 0, "logit_bias": LETTERS}
        body.update({"messages": [{"role": "user", "content": prompt}]} if kind == "chat" else {"prompt": prompt})
        r = await client.post(f"/t/{tenant}/v1/{'chat/completions' if kind == 'chat' else 'completions'}",
                              json=body, headers={"Authorization": f"Bearer {keys[tenant]}"})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        assert len(text) == MAX_REF and text.isalpha() and text.islower(), text
        return (kind, prompt, ref), text

    async with httpx.AsyncClient(base_url=srv.url, timeout=120) as client:
        return dict(await asyncio.gather(*(one(client, *w) for w in wanted)))


async def _operator(srv: ServerProcess, new_version: Path, log: list) -> None:
    """Hot-swaps, an upload, a version delete, load/pin/unload, while traffic runs."""
    sw, pm = "/admin/v1/tenants/alpha/adapters/swap", "/admin/v1/tenants/alpha/adapters/pinme"
    ops = [("PUT", sw + "/active", {"json": {"version": 2}}), ("POST", pm + "/load", {"json": {"tier": "device", "pin": True}}),
           ("PUT", sw + "/active", {"json": {"version": 1}}), ("POST", sw + "/versions", {"files": _files(new_version)}),
           ("PUT", sw + "/active", {"json": {"version": 2}}), ("DELETE", sw + "/versions/3", {}),
           ("POST", pm + "/unload", {}), ("PUT", sw + "/active", {"json": {"version": 1}}),
           ("POST", pm + "/load", {"json": {"tier": "host"}}), ("PUT", sw + "/active", {"json": {"version": 2}}),
           ("POST", sw + "/load", {"json": {"tier": "device", "pin": True}}), ("PUT", sw + "/active", {"json": {"version": 1}}),
           ("POST", pm + "/unload", {}), ("POST", sw + "/unload", {}), ("PUT", sw + "/active", {"json": {"version": 2}}),
           ("POST", pm + "/load", {"json": {"tier": "device", "pin": True}}), ("PUT", sw + "/active", {"json": {"version": 1}})]
    async with httpx.AsyncClient(base_url=srv.url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as c:
        await asyncio.sleep(0.5)
        for method, path, kw in ops:
            for _ in range(50):  # a load finding every slot busy is a 409 to retry
                r = await c.request(method, path, **kw)
                if r.status_code != 409 or "Retry-After" not in r.headers:
                    break
                await asyncio.sleep(0.1)
            log.append((f"{method} {path} {kw.get('json', '')}", r.status_code, r.text[:300], time.monotonic()))
            await asyncio.sleep(0.1)


async def _traffic(chaos: Chaos, new_version: Path) -> None:
    limits = httpx.Limits(max_connections=USERS + 20, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=chaos.srv.url, timeout=60, limits=limits) as client:
        async def user(requests):
            for p in requests:
                chaos.outcomes[p.idx] = await run_one(client, p, chaos.keys)

        op = asyncio.ensure_future(_operator(chaos.srv, new_version, chaos.admin_log))
        await asyncio.gather(*(user(r) for r in chaos.plan))
        chaos.traffic_done_at = time.monotonic()
        await op


def _wait_idle(srv: ServerProcess, timeout: float = 5.0) -> dict:
    """bench_serving's idle read, until no KV block is held and nothing is in flight."""
    deadline = time.monotonic() + timeout
    while True:
        idle = ss.idle_state(srv.url, ADMIN_KEY, timeout=timeout)
        busy = [idle[k] for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "in_flight")]
        clean = busy == [0, 0, 0, 0]
        if (clean and idle["num_blocks_free"] == idle["num_blocks_total"]) or time.monotonic() > deadline:
            return {**idle, "waited_s": timeout - (deadline - time.monotonic())}
        time.sleep(0.1)


@pytest.fixture(scope="module")
def chaos(tmp_path_factory) -> Chaos:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("chaos")
    model_dir = make_tiny_model_dir(root / "model", "llama", seed=7)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    ad = {i: make_peft_adapter(base, root / "adapters" / str(i), seed=40 + i, r=4 + 4 * (i % 2)) for i in range(5)}
    srv = start_server(
        root / "home", model_dir, "--kv-cache-bytes", str(2 << 20), "--max-model-len", str(LIMITS["max_model_len"]),
        "--max-body-bytes", str(LIMITS["max_body_bytes"]), "--max-loras", "3",
        "--max-concurrent-requests-per-tenant", str(TENANT_LIMIT),
    )
    try:
        keys = {"bogus": "lpx_not-a-key"}
        with srv.admin() as c:
            for t in ("alpha", "beta", "gamma"):
                assert c.post("/admin/v1/tenants", json={"name": t}).status_code == 201
                keys[t] = c.post(f"/admin/v1/tenants/{t}/keys").json()["key"]
            shas = {}
            for tenant, name, i in (("alpha", "swap", 0), ("alpha", "swap", 1), ("alpha", "swap", 2),
                                    ("alpha", "pinme", 3), ("beta", "solo", 1)):  # solo shares swap@2's weights
                r = c.post(f"/admin/v1/tenants/{tenant}/adapters/{name}/versions", files=_files(ad[i]))
                assert r.status_code in (200, 201), r.text
                shas[f"{name}@{r.json()['version']}"] = r.json()["sha256"]
        plan = make_plan(SEED, USERS, PER_USER, MODELS, LIMITS)
        flat = [p for user in plan for p in user]
        chaos = Chaos(srv, root / "home", keys, plan, [Outcome()] * len(flat), shas=shas)
        # swap@3 is deleted during the chaos: its references are taken before
        v3 = [(kind, prompt, "alpha:swap@3") for kind in ("chat", "completion") for prompt in PROMPTS]
        chaos.refs = asyncio.run(_references(srv, keys, v3))
        chaos.metrics_before = metric_samples(httpx.get(srv.url + "/metrics").text)
        log_offset = srv.log_path.stat().st_size
        start = time.monotonic()
        asyncio.run(_traffic(chaos, ad[4]))
        chaos.traffic_s = time.monotonic() - start
        chaos.idle = _wait_idle(srv)
        chaos.metrics_after = metric_samples(httpx.get(srv.url + "/metrics").text)
        with srv.admin() as c:
            chaos.status = c.get("/admin/v1/status").json()
        chaos.records, _ = ss.access_records(srv.log_path, log_offset)
        wanted = {(p.compare[0], p.compare[1], ref) for p in flat if p.compare for ref in p.compare[2]}
        chaos.refs.update(asyncio.run(_references(srv, keys, sorted(w for w in wanted if w[2] != "alpha:swap@3"))))
        yield chaos
    finally:
        srv.stop()


def _flat(chaos: Chaos):
    return [p for user in chaos.plan for p in user]


def test_operator_actions_all_succeeded_while_traffic_ran(chaos):
    assert [op for op in chaos.admin_log if op[1] >= 300] == []
    assert len(chaos.admin_log) == 17 and sum(op[3] < chaos.traffic_done_at for op in chaos.admin_log) >= 15  # under traffic
    with chaos.srv.admin() as c:
        swap = c.get("/admin/v1/tenants/alpha/adapters/swap").json()
    assert swap["active_version"] == 1 and [v["version"] for v in swap["versions"]] == [1, 2, 4]
    # the version deleted mid-traffic answered before (admitted requests finished) and 404 after
    v3 = Counter(o.status for p, o in zip(_flat(chaos), chaos.outcomes) if p.body and p.body.get("model") == "swap@3")
    assert v3[200] > 0 and v3[404] > 0, v3
    o = chaos.outcomes
    print(f"\nchaos (seed {SEED}): {len(o)} requests in {chaos.traffic_s:.1f}s: statuses {dict(Counter(x.status for x in o))}, "
          f"done {sum(x.done for x in o)}, cut {sum(x.cut for x in o)}, abandoned {sum(x.abandoned for x in o)}; "
          f"idle after {chaos.idle['waited_s']:.2f}s, preemptions {chaos.idle['num_preemptions']}")


def test_every_answer_well_formed_and_never_5xx(chaos):
    problems = [(p.idx, p.path, p.body and {k: v for k, v in p.body.items() if k not in ("prompt", "messages")}, o.problems)
                for p, o in zip(_flat(chaos), chaos.outcomes) if o.problems]
    assert problems == [], problems[:10]
    statuses = Counter(o.status for o in chaos.outcomes if not o.abandoned)
    assert all(s is not None and s < 500 for s in statuses), statuses
    # the mix really happened: completed streams and JSON, cut streams, abandoned calls, refusals
    assert sum(o.done for o in chaos.outcomes) > 200 and sum(o.cut for o in chaos.outcomes) > 30
    assert sum(o.abandoned for o in chaos.outcomes) > 5 and {400, 401, 404, 413} <= set(statuses)


def test_outputs_equal_references_no_stale_or_mixed_weights(chaos):
    checked, wrong, swap_versions = 0, [], set()
    for p, o in zip(_flat(chaos), chaos.outcomes):
        if not p.compare or o.texts is None or o.problems:
            continue
        kind, prompt, candidates = p.compare
        want = {c: expected(chaos.refs[(kind, prompt, c)], p.body.get("max_tokens", 16), p.body.get("stop"))
                for c in candidates}
        if o.done:  # every choice from one and the same version
            ok = any(all((t, f) == w for t, f in zip(o.texts, o.finishes)) for w in want.values())
        else:  # a cut stream: what arrived is the start of the answer
            ok = any(all(w[0].startswith(t) for t in o.texts) for w in want.values())
        checked += 1
        if o.done and p.body["model"] == "swap":
            swap_versions |= {c for c, w in want.items() if all((t, f) == w for t, f in zip(o.texts, o.finishes))}
        if not ok:
            wrong.append((p.idx, p.body["model"], p.body.get("stop"), p.body.get("max_tokens"), o.texts, o.finishes, want))
    assert wrong == [], wrong[:5]
    assert checked > 300 and swap_versions == set(SWAP)  # by name: both versions served, never a mix


def test_idle_and_clean_afterwards(chaos):
    idle = chaos.idle
    assert idle["num_requests_running"] == 0 and idle["num_requests_waiting"] == 0 and idle["in_flight"] == 0, idle
    assert idle["kv_cache_usage_perc"] == 0 and idle["num_blocks_free"] == idle["num_blocks_total"], idle
    assert idle["waited_s"] < 5, idle
    # no adapter still counted as in use: by the server's gauges, by the engine's reference counts
    st = chaos.status
    assert (st["running_lora_adapters"], st["waiting_lora_adapters"]) == ([], []), st
    held = {a: v["outstanding_requests"] for a, v in st["engine"]["lora"]["adapters"].items() if v["outstanding_requests"]}
    assert held == {}
    (info,) = [labels for name, labels, _ in chaos.metrics_after if name == "vllm:lora_requests_info"]
    assert info["running_lora_adapters"] == info["waiting_lora_adapters"] == "", info
    # nothing in a staging, trash or temp folder (files or folders), no partial file anywhere
    leftovers = [str(p.relative_to(chaos.home)) for p in chaos.home.rglob("*")
                 if {"staging", "trash", ".tmp"} & set(p.relative_to(chaos.home).parts[:-1]) or p.suffix in (".part", ".tmp")]
    assert leftovers == []
    # the deleted version's weights left the blob store and the local cache once its last request ended
    blobs = [p.name for p in (chaos.home / "blobs").rglob("*") if p.is_file()]
    assert chaos.shas["swap@3"] not in str(list(chaos.home.rglob("*"))) and len(blobs) == 4, blobs


def _delta(chaos: Chaos, name: str, **match) -> dict:
    """After - before of one metric, per label set (as a tuple of label values)."""
    out: Counter = Counter()
    for sign, samples in ((1, chaos.metrics_after), (-1, chaos.metrics_before)):
        for n, labels, value in samples:
            if n == name and all(labels.get(k) in v for k, v in match.items()):
                out[tuple(labels.values())] += sign * value
    return out


def test_metrics_agree_with_traffic_and_access_log(chaos):
    flat = _flat(chaos)
    sent = Counter(o.status for o in chaos.outcomes if not o.abandoned)
    abandoned = sum(o.abandoned for o in chaos.outcomes)
    http = Counter()
    for (route, status), v in _delta(chaos, "loraplex_http_requests_total", route=TENANT_ROUTES).items():
        http[int(status)] += v
    # an abandoned call may be given up before its request was out
    assert len(flat) - abandoned <= sum(http.values()) <= len(flat), (http, sent)
    for status in set(http) | set(sent):  # an abandoned call ends as 200, 499 or 429 on the server
        assert sent[status] <= http[status] <= sent[status] + abandoned, (status, http, sent)
    assert [k for k, v in _delta(chaos, "loraplex_http_requests_total").items() if int(k[1]) >= 500 and v] == []
    admitted = sum(_delta(chaos, "loraplex_adapter_requests_total").values())
    # an admitted run's line has "stream"; a refused request's has "model" (both have a request_id:
    # the x-request-id it was answered with)
    ran = [r for r in chaos.records if "stream" in r]
    assert sent[200] <= admitted <= sent[200] + abandoned and admitted == len(ran)
    # one access line per call that reached a route (413s are refused before), with its HTTP status
    # (a stream's is 200 once its headers are out, whatever its line says)
    logged = Counter(200 if r.get("stream") else r["status"] for r in chaos.records)
    assert logged == {s: v for s, v in http.items() if s != 413 and v}, (logged, http)
    assert all(r["status"] < 500 for r in chaos.records)
    assert sum(_delta(chaos, "vllm:request_success_total").values()) == sum(r["status"] == 200 for r in ran)
    assert sum(_delta(chaos, "vllm:generation_tokens_total").values()) == sum(r["completion_tokens"] for r in ran)
    assert sum(_delta(chaos, "vllm:prompt_tokens_total").values()) == sum(r["prompt_tokens"] for r in ran if r["status"] == 200)


def test_server_log_has_no_trouble(chaos):
    log = chaos.srv.log()
    trouble = [line for line in ss.server_problems(log) if not line.startswith('{"event":"request"') or '"status":5' in line]
    assert trouble == []
    assert [line for line in log.splitlines() if " WARNING " in line] == []  # e.g. asyncio's writes to lost sockets


def test_tenant_slots_all_given_back(chaos):
    """Exactly TENANT_LIMIT streams of one tenant are admitted together, the next one is a 429:
    the counter is back at 0 (not above, which would refuse early; not below, which would admit
    more than the limit)."""
    async def burst():
        limits = httpx.Limits(max_connections=TENANT_LIMIT + 10, max_keepalive_connections=0)
        headers = {"Authorization": f"Bearer {chaos.keys['alpha']}"}
        body = {"model": "base-model", "prompt": "hold", "max_tokens": 200, "ignore_eos": True, "stream": True}
        async with httpx.AsyncClient(base_url=chaos.srv.url, headers=headers, timeout=60, limits=limits) as c:
            streams = [c.stream("POST", "/v1/completions", json=body) for _ in range(TENANT_LIMIT)]
            opened = await asyncio.gather(*(s.__aenter__() for s in streams))
            try:
                extra = await c.post("/v1/completions", json={**body, "stream": False})
                return [r.status_code for r in opened], extra.status_code
            finally:
                for s in streams:
                    await s.__aexit__(None, None, None)

    statuses, extra = asyncio.run(burst())
    assert statuses == [200] * TENANT_LIMIT and extra == 429
    idle = _wait_idle(chaos.srv)
    assert idle["kv_cache_usage_perc"] == 0 and idle["in_flight"] == 0 and idle["num_requests_running"] == 0
