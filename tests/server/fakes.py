"""Small stand-ins for the engine and adapter manager, for testing the HTTP layer alone.

The fake engine is deterministic: output token ``k`` of a request is a function of the prompt,
the adapter's content hash, the seed and ``k``, so tests can compute the expected text
independently. It honours max_tokens, n, stop strings and abort, and keeps KV-block accounting
so leak tests mean something.
"""

from __future__ import annotations

import asyncio
import hashlib
import re
import threading
from pathlib import Path

from loraplex.engine.outputs import CompletionOutput, RequestOutput
from loraplex.lora.spec import AdapterRef
from loraplex.sampling_params import InvalidRequestError

VOCAB_OFFSET = 3  # 0 pad, 1 bos, 2 eos
LETTERS = "abcdefghijklmnopqrstuvwxyz "


# a thinking model's tags, one token each as in Qwen3's and DeepSeek-R1's vocabularies, so that a
# server with --reasoning-parser starts on the fake (the parser refuses a tokenizer without them)
THINK_TAGS = {"<think>": VOCAB_OFFSET + len(LETTERS), "</think>": VOCAB_OFFSET + len(LETTERS) + 1}
_TAG_SPLIT = re.compile("(" + "|".join(map(re.escape, THINK_TAGS)) + ")")


class FakeTokenizer:
    """Character-level tokenizer: one token per character of ``LETTERS`` (others dropped), and
    ``<think>`` / ``</think>`` as one token each."""

    chat_template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
    eos_token_id = 2

    def __len__(self) -> int:
        return VOCAB_OFFSET + len(LETTERS) + 4

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        ids = []
        for part in _TAG_SPLIT.split(text):
            if part in THINK_TAGS:
                ids.append(THINK_TAGS[part])
            else:
                ids += [VOCAB_OFFSET + LETTERS.index(c) for c in part.lower() if c in LETTERS]
        return {"input_ids": ([1] if add_special_tokens else []) + ids}

    def get_vocab(self) -> dict[str, int]:
        return {**{c: VOCAB_OFFSET + i for i, c in enumerate(LETTERS)}, **THINK_TAGS}

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        tags = {i: tag for tag, i in THINK_TAGS.items()}
        return "".join(LETTERS[i - VOCAB_OFFSET] if VOCAB_OFFSET <= i < VOCAB_OFFSET + len(LETTERS) else tags.get(i, "")
                       for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, tools=None):
        # tools and earlier tool calls are named in the prompt, so tests can see them reach it
        text = "".join(f"tool {t['function']['name']} " for t in tools or [])
        for m in messages:
            calls = "".join(f"call {c['function']['name']} " for c in m.get("tool_calls", []))
            text += f"{m['role']} {m['content']} {calls}"
        return text + ("assistant " if add_generation_prompt else "")


def fake_token(prompt_ids: list[int], adapter_id: str | None, seed, choice: int, k: int) -> int:
    h = hashlib.sha256(f"{prompt_ids}|{adapter_id}|{seed}|{choice}|{k}".encode()).digest()
    return VOCAB_OFFSET + h[0] % len(LETTERS)


def expected_text(tok: FakeTokenizer, prompt_ids, adapter_id, seed, max_tokens, choice=0) -> str:
    return tok.decode([fake_token(prompt_ids, adapter_id, seed, choice, k) for k in range(max_tokens)])


class FakeEngine:
    """Async engine facade with the AsyncLLMEngine surface the server uses."""

    def __init__(self, step_seconds: float = 0.0, num_blocks: int = 1000, block_size: int = 4, max_model_len: int = 128):
        self.tokenizer = FakeTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.step_seconds = step_seconds
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._lock = threading.Lock()
        self.blocks_in_use: dict[str, int] = {}
        self.aborted: set[str] = set()
        self.failed: dict[str, BaseException] = {}  # request_id -> what fail_all_requests ends it with
        self.started: list[tuple[str, str | None]] = []  # (request_id, adapter content hash)
        self.params_seen: dict[str, object] = {}  # request_id -> the SamplingParams it ran with
        self.prompts_seen: dict[str, list[int]] = {}  # request_id -> the prompt token ids it ran with
        self.salts_seen: dict[str, str | None] = {}  # request_id -> the prefix-cache salt it ran with
        self.scheduling_seen: dict[str, tuple[int, str | None]] = {}  # request_id -> (priority, tenant)
        self.weights_seen: dict[str, float] = {}  # request_id -> the tenant_weight it ran with
        self.loaded: dict[str, tuple[str, bool]] = {}
        self.unloaded: list[str] = []  # content hashes given to unload_adapter, in order
        self.forgotten: list[str] = []  # content hashes given to forget_adapters, in order
        self.shut_down = False
        self.flushes = 0  # prefix-cache flushes done

    def _blocks(self, n_tokens: int) -> int:
        return -(-n_tokens // self.block_size)

    async def generate(self, prompt, params, request_id=None, adapter=None, cache_salt=None, priority=0,
                       tenant=None, tenant_weight=1.0):
        if isinstance(prompt, str):
            prompt = self.tokenizer(prompt)["input_ids"]
        if not prompt:
            raise InvalidRequestError("empty prompt", param="prompt")
        adapter_id = adapter.content_hash if isinstance(adapter, AdapterRef) else adapter
        with self._lock:
            self.started.append((request_id, adapter_id))
            self.params_seen[request_id] = params
            self.prompts_seen[request_id] = list(prompt)
            self.salts_seen[request_id] = cache_salt
            self.scheduling_seen[request_id] = (priority, tenant)
            self.weights_seen[request_id] = tenant_weight
            self.blocks_in_use[request_id] = self._blocks(len(prompt)) * params.n
        try:
            texts = [""] * params.n
            done = [False] * params.n
            for k in range(params.max_tokens):
                await asyncio.sleep(self.step_seconds)
                if request_id in self.failed:
                    raise self.failed[request_id]
                if request_id in self.aborted:
                    # as AsyncLLMEngine.abort: a stream still read ends with an "abort" delta
                    yield RequestOutput(request_id, None, list(prompt),
                                        [CompletionOutput(c, "", [], "abort", None, None)
                                         for c in range(params.n) if not done[c]], True, adapter_id)
                    return
                outs = []
                for c in range(params.n):
                    if done[c]:
                        continue
                    tok = fake_token(prompt, adapter_id, params.seed, c, k)
                    text = self.tokenizer.decode([tok])
                    texts[c] += text
                    finish = stop_reason = None
                    hit = [s for s in params.stop if s in texts[c]]
                    if hit:  # the engine's stop_reason: the stop string
                        finish, text, stop_reason = "stop", "", hit[0]
                    elif k == params.max_tokens - 1:
                        finish = "length"
                    done[c] = finish is not None
                    lp = [{"token_id": tok, "logprob": -0.5, "top_logprobs": {tok: -0.5, VOCAB_OFFSET: -1.5}}]
                    outs.append(CompletionOutput(c, text, [tok], finish, lp if params.logprobs is not None else None,
                                                 stop_reason))
                with self._lock:
                    self.blocks_in_use[request_id] = self._blocks(len(prompt) + k + 1) * params.n
                finished = all(done)
                yield RequestOutput(request_id, None, list(prompt), outs, finished, adapter_id)
                if finished:
                    return
        finally:
            with self._lock:
                self.blocks_in_use.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self.aborted.add(request_id)
            self.blocks_in_use.pop(request_id, None)

    async def fail_all_requests(self, error: BaseException) -> int:
        """As AsyncLLMEngine's: each open request's stream raises ``error`` at its next step."""
        with self._lock:
            ids = list(self.blocks_in_use)
            for request_id in ids:
                self.failed[request_id] = error
                self.blocks_in_use.pop(request_id)
        return len(ids)

    async def flush_prefix_cache(self) -> bool:
        """The engine's rule: flushed only when nothing runs (``flushes`` counts them)."""
        with self._lock:
            if self.blocks_in_use:
                return False
        self.flushes += 1
        return True

    async def load_adapter(self, ref, tier="device", pin=False):
        self.loaded[ref.content_hash] = (tier, pin)

    async def unload_adapter(self, adapter_id):
        self.unloaded.append(adapter_id)
        self.loaded.pop(adapter_id, None)

    async def forget_adapters(self, adapter_ids):
        self.forgotten.extend(adapter_ids)
        return []

    def stats(self) -> dict:
        with self._lock:
            used = sum(self.blocks_in_use.values())
            running = len(self.blocks_in_use)
        return {
            "num_requests_running": running,
            "num_requests_waiting": 0,
            "kv_cache_usage": used / self.num_blocks,
            "num_blocks_free": self.num_blocks - used,
            "num_blocks_total": self.num_blocks,
            "lora": {
                "adapters": {h: {"tier": t, "pinned": p, "loads": 1} for h, (t, p) in self.loaded.items()},
                "tiers": {"device": sum(t == "device" for t, _ in self.loaded.values()), "host": 0},
            },
        }

    def shutdown(self) -> None:
        self.shut_down = True


class GatedEngine(FakeEngine):
    """The fake engine, holding every output while ``gate`` is clear (the request has started)."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.gate.set()

    async def generate(self, *args, **kwargs):
        async for out in super().generate(*args, **kwargs):
            while not self.gate.is_set():
                await asyncio.sleep(0.005)
            yield out


class FakeAdapterManager:
    """Uploads record the two files' sha256 as the version's content hash (no validation)."""

    def __init__(self, registry, root: Path):
        self.registry = registry
        self.root = root
        self.in_use: dict[str, int] = {}

    def upload(self, tenant, name, adapter_dir, uploader, warnings=None):
        adapter_dir = Path(adapter_dir)
        cfg = (adapter_dir / "adapter_config.json").read_bytes()
        weights = (adapter_dir / "adapter_model.safetensors").read_bytes()
        sha = hashlib.sha256(cfg + b"|" + weights).hexdigest()
        return self.registry.add_version(
            tenant, name, sha256=sha, base_model="fake-model", rank=4, alpha=8.0, targets=["q_proj"],
            size_bytes=len(weights), blob_key=f"sha256/{sha}", uploader=uploader,
        )

    def resolve(self, tenant, model_ref, *, acquire=False):
        v = self.registry.resolve(tenant, model_ref)
        if acquire:
            self.acquire(v.sha256)
        return AdapterRef(name=f"{v.adapter}@{v.version}", path=str(self.root / v.sha256), content_hash=v.sha256)

    def acquire(self, content_hash):
        self.in_use[content_hash] = self.in_use.get(content_hash, 0) + 1

    def release(self, content_hash):
        self.in_use[content_hash] -= 1

    def tier_of(self, content_hash):
        return "store"
