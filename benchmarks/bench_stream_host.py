"""Server CPU per streamed token: the HTTP layer of an OpenAI stream, without a model.

    .venv/bin/python benchmarks/bench_stream_host.py [--streams 50 200] [--tokens 200]
        [--cases chat completions chat-usage completions-usage] [--rounds 3]

The real app (``create_app``: routes, middleware, ``SSEResponse``) runs in this process over the
real ``AsyncLLMEngine`` (its engine thread, the per-step hand-off to the event loop), whose
``LLMEngine`` is replaced by ``TokenCore``: each step gives every running request one token of
text at once (a fixed cycle of word pieces, one of them non-ASCII), sleeping ``--step-ms`` first
as a GPU step would (sleeping costs no CPU). Requests go straight to the ASGI app (no socket, no
HTTP parser: those are uvicorn's) with a ``send`` that only counts bytes, ``--streams`` at once,
``--tokens`` tokens each, and ``stream: true`` (``-usage``: with ``stream_options.include_usage``).

Printed per case: CPU us per streamed token (tokens the engine gave the streams), of the whole
process and of the event-loop thread alone (chunk building, JSON, the queues' receiving side,
the ASGI sends), measured from the moment every stream has its first token to the moment all
have ended, best (lowest) of ``--rounds`` rounds: this VM's speed drifts, and the lowest CPU
time of a repeated run is the figure that repeats.

``--uvicorn``: the app behind a real uvicorn on a loopback port instead (its HTTP protocol
writes the chunks: h11, or httptools where installed), the clients in a subprocess (raw HTTP/1.1
over asyncio streams), so this process's CPU is the server's alone; measured from the step in
which every request is running. ``--http h11`` / ``httptools`` (``loraplex serve``'s) picks uvicorn's protocol,
``--loop uvloop`` runs the server on uvloop (the clients stay on asyncio).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from loraplex.engine.async_engine import AsyncLLMEngine  # noqa: E402
from loraplex.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402

# word pieces as a tokenizer gives them; one non-ASCII piece so the JSON escapes nothing but
# still writes UTF-8
PIECES = [" the", " quick", " brown", " fox", " jumps", " over", " the", " lazy", " dog", ",", " caf\u00e9", "."]
CASES = {
    "chat": ("/v1/chat/completions", False),
    "chat-usage": ("/v1/chat/completions", True),
    "completions": ("/v1/completions", False),
    "completions-usage": ("/v1/completions", True),
}


class _Tokenizer:
    """What the server asks of a tokenizer on these paths: prompts, a chat template."""

    chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    eos_token_id = 2

    def __len__(self) -> int:
        return 1000

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": [1 + (ord(c) % 900) for c in text][:64] or [1]}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(PIECES[i % len(PIECES)] for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kw):
        return " ".join(str(m["content"]) for m in messages)


class TokenCore:
    """The ``LLMEngine`` surface ``AsyncLLMEngine`` drives: each step, one token per running
    request, after ``step_s`` of sleep (a GPU step's wall time, no CPU)."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.driver = None
        self.lora_manager = None
        self.sampling_defaults = None
        self.tokenizer = _Tokenizer()
        self.model_name = "bench-model"
        self.max_model_len = 1 << 16
        self.vocab_size = 1000
        self.last_step_was_empty = False
        self.tokens = 0  # given to streams, all requests
        self._running: dict[str, list] = {}  # request id -> [params, tokens given]
        # (requests, callback): the callback runs once, on the engine thread, at the start of
        # the first step with that many requests running (--uvicorn's start of measurement)
        self.when_running: tuple[int, object] | None = None

    def stats(self) -> dict:
        return {"num_requests_running": len(self._running), "num_requests_waiting": 0, "kv_cache_usage": 0.0,
                "num_blocks_free": 1000, "num_blocks_total": 1000, "lora": {"adapters": {}, "tiers": {}}}

    def prepare_request(self, request_id, prompt, params, *args, **kwargs):
        return SimpleNamespace(request_id=request_id, prompt=list(prompt), params=params, adapter_id=None)

    def resolve_adapter(self, adapter, prepared):
        return None

    def add_prepared(self, req) -> None:
        self._running[req.request_id] = [req, 0]

    def has_unfinished(self) -> bool:
        return bool(self._running)

    def abort(self, request_id: str):
        entry = self._running.pop(request_id, None)
        if entry is None:
            return None
        return RequestOutput(request_id, None, entry[0].prompt, [CompletionOutput(0, "", [], "abort")], True)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_s)
        if self.when_running is not None and len(self._running) >= self.when_running[0]:
            callback, self.when_running = self.when_running[1], None
            callback()
        outs = []
        for rid, entry in list(self._running.items()):
            req, k = entry
            entry[1] = k + 1
            last = k + 1 >= req.params.max_tokens
            tok = k % len(PIECES)
            outs.append(RequestOutput(rid, None, req.prompt, [CompletionOutput(0, PIECES[tok], [tok],
                                                                                "length" if last else None)], last))
            if last:
                del self._running[rid]
        self.tokens += len(outs)
        return outs


class _Lifespan:
    """The app's lifespan (startup, shutdown) driven over ASGI."""

    def __init__(self, app):
        self.app, self.inbox, self.outbox = app, asyncio.Queue(), asyncio.Queue()

    async def start(self) -> None:
        self.task = asyncio.ensure_future(self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                   self.inbox.get, self.outbox.put))
        await self.inbox.put({"type": "lifespan.startup"})
        msg = await self.outbox.get()
        assert msg["type"] == "lifespan.startup.complete", msg

    async def stop(self) -> None:
        await self.inbox.put({"type": "lifespan.shutdown"})
        await self.outbox.get()
        await self.task


def _thread_cpu(thread: threading.Thread) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


class _AsgiClient:
    """One streamed request to the app: counts its body bytes and events."""

    def __init__(self, app, key: str, path: str, body: bytes, on_first):
        self.app, self.path, self.body, self.on_first = app, path, body, on_first
        self.headers = [(b"host", b"bench"), (b"authorization", f"Bearer {key}".encode()),
                        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        self.bytes = 0
        self.events = 0
        self.status = None
        self.tail = b""  # the last bytes, to check the stream ended with [DONE]
        self._sent_body = False
        self._closed = asyncio.get_running_loop().create_future()

    async def receive(self) -> dict:
        if not self._sent_body:
            self._sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self._closed  # the client stays until the response ends
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            return
        body = message.get("body", b"")
        if body:
            self.bytes += len(body)
            self.events += 1
            self.tail = body
            if self.events == 2:  # the role chunk (chat) or the first text, then a token
                self.on_first()

    async def run(self) -> None:
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                 "scheme": "http", "path": self.path, "raw_path": self.path.encode(), "query_string": b"",
                 "root_path": "", "headers": self.headers, "client": ("127.0.0.1", 40000),
                 "server": ("127.0.0.1", 8000), "state": {}}
        try:
            await self.app(scope, self.receive, self.send)
        finally:
            if not self._closed.done():
                self._closed.set_result(None)


async def _round(app, engine: AsyncLLMEngine, key: str, case: str, streams: int, tokens: int) -> dict:
    path, with_usage = CASES[case]
    raw = json.dumps(_body(path, with_usage, tokens)).encode()
    core: TokenCore = engine.engine
    loop_thread = threading.current_thread()
    started = 0
    mark: dict = {}

    def on_first() -> None:
        nonlocal started
        started += 1
        if started == streams:  # every stream runs: the steady state begins
            mark.update(proc=time.process_time(), loop=_thread_cpu(loop_thread), tokens=core.tokens)

    clients = [_AsgiClient(app, key, path, raw, on_first) for _ in range(streams)]
    await asyncio.gather(*(c.run() for c in clients))
    proc, loop_cpu, given = time.process_time(), _thread_cpu(loop_thread), core.tokens
    for c in clients:
        assert c.status == 200 and c.tail.endswith(b"data: [DONE]\n\n"), (c.status, c.tail[-80:])
    n = given - mark["tokens"]
    return {"proc_us": (proc - mark["proc"]) / n * 1e6, "loop_us": (loop_cpu - mark["loop"]) / n * 1e6,
            "bytes_per_token": sum(c.bytes for c in clients) / (streams * tokens)}


_CLIENT = r"""
import asyncio, json, sys

port, path, key, streams, body = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5].encode()
head = (f"POST {path} HTTP/1.1\r\nHost: bench\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()

async def one():
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head + body)
    got, tail = 0, b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            break
        got += len(data)
        tail = (tail + data)[-64:]
    writer.close()
    return got, b"data: [DONE]" in tail

async def main():
    results = await asyncio.gather(*(one() for _ in range(streams)))
    print(json.dumps({"bytes": sum(r[0] for r in results), "done": sum(r[1] for r in results)}))

asyncio.run(main())
"""


async def _uvicorn_round(port: int, engine: AsyncLLMEngine, key: str, case: str, streams: int, tokens: int) -> dict:
    path, with_usage = CASES[case]
    raw = json.dumps(_body(path, with_usage, tokens))
    core: TokenCore = engine.engine
    main_thread = threading.current_thread()
    mark: dict = {}

    def on_running() -> None:
        mark.update(proc=time.process_time(), loop=_thread_cpu(main_thread), tokens=core.tokens)

    core.when_running = (streams, on_running)
    client = await asyncio.create_subprocess_exec(sys.executable, "-c", _CLIENT, str(port), path, key, str(streams),
                                                  raw, stdout=asyncio.subprocess.PIPE)
    out, _ = await client.communicate()
    proc, loop_cpu, given = time.process_time(), _thread_cpu(main_thread), core.tokens
    got = json.loads(out)
    assert got["done"] == streams, got
    n = given - mark["tokens"]
    return {"proc_us": (proc - mark["proc"]) / n * 1e6, "loop_us": (loop_cpu - mark["loop"]) / n * 1e6,
            "bytes_per_token": got["bytes"] / (streams * tokens)}


def _body(path: str, with_usage: bool, tokens: int) -> dict:
    body: dict = {"model": "bench-model", "max_tokens": tokens, "stream": True}
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Tell me about foxes."}]
    else:
        body["prompt"] = "Tell me about foxes."
    if with_usage:
        body["stream_options"] = {"include_usage": True}
    return body


async def _main(args) -> None:
    from loraplex.config import Settings
    from loraplex.registry import db
    from loraplex.registry.service import RegistryService
    from loraplex.server.app import create_app

    home = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    url = f"sqlite:///{home / 'registry.db'}"
    db.upgrade(url)
    registry = RegistryService.from_url(url)
    registry.create_tenant("bench")
    _, key = registry.create_api_key("bench")
    engine = AsyncLLMEngine(None, engine=TokenCore(args.step_ms / 1000))
    # usage accounting off: its background flush thread would run on the measured CPU clock
    settings = Settings(home=home, admin_key="bench-admin", database_url=url, usage_flush_seconds=0,
                        max_concurrent_requests_per_tenant=100000)
    app = create_app(settings, engine=engine, registry=registry, adapters=SimpleNamespace())
    if args.uvicorn:
        import socket

        import uvicorn

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="on", log_level="warning",
                                               http=_http_protocol(args.http)))
        serving = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)

        async def run_round(case, streams, tokens):
            return await _uvicorn_round(port, engine, key, case, streams, tokens)
    else:
        lifespan = _Lifespan(app)
        await lifespan.start()

        async def run_round(case, streams, tokens):
            return await _round(app, engine, key, case, streams, tokens)
    logging_off()
    gc.collect()
    gc.freeze()  # as `loraplex serve` does once loaded
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} streams={args.streams} tokens={args.tokens} step_ms={args.step_ms} "
          f"rounds={args.rounds} {f'uvicorn http={args.http}' if args.uvicorn else 'asgi'} loop={args.loop} "
          "(best round; CPU us per streamed token)")
    print("| case | streams | process us/token | event loop us/token | bytes/token |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for streams in args.streams:
        for case in args.cases:
            await run_round(case, min(streams, 8), 4)  # warm the paths
            results = [await run_round(case, streams, args.tokens) for _ in range(args.rounds)]
            best = min(results, key=lambda r: r["proc_us"])
            loop_best = min(r["loop_us"] for r in results)
            print(f"| {case} | {streams} | {best['proc_us']:.1f} | {loop_best:.1f} | {best['bytes_per_token']:.0f} |",
                  flush=True)
    if args.uvicorn:
        server.should_exit = True
        await serving
    else:
        await lifespan.stop()


def _http_protocol(name: str):
    """uvicorn's ``http`` for ``--http``: httptools is the protocol ``loraplex serve`` runs."""
    if name == "httptools":
        from loraplex.server.http_protocol import BoundedHttpToolsProtocol

        return BoundedHttpToolsProtocol
    return name


def logging_off() -> None:
    """The access log line per request is real work, but its handler (stderr here) is not the
    server's: keep the formatting, drop the write."""
    import logging

    logging.getLogger("loraplex.access").addHandler(logging.NullHandler())
    logging.getLogger("loraplex.access").propagate = False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", type=int, nargs="+", default=[50, 200])
    p.add_argument("--tokens", type=int, default=200, help="tokens per stream")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--step-ms", type=float, default=5.0, help="wall time of an engine step (sleep)")
    p.add_argument("--uvicorn", action="store_true", help="behind uvicorn on a port, clients in a subprocess")
    p.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"],
                   help="uvicorn's HTTP protocol (httptools: as `loraplex serve` runs it, with its head bound)")
    p.add_argument("--loop", default="asyncio", choices=["asyncio", "uvloop"], help="the server's event loop")
    args = p.parse_args()
    loop_factory = None
    if args.loop == "uvloop":
        import uvloop

        loop_factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(_main(args))


if __name__ == "__main__":
    main()
