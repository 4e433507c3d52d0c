"""LoRAX's native API against a real ``loraplex serve`` (the shared server of compat_server.py, a
tiny random Llama with one token per byte), driven by LoRAX's own Python client (``lorax-client``,
``lorax.Client`` / ``AsyncClient``, which post to the base URL: loraplex's ``POST /t/{tenant}``)
and by plain HTTP: greedy ``generate`` equals the OpenAI route's completion for the same prompt
and adapter, streamed tokens join into the final text, details (finish reasons, token counts,
seeds, prefill, alternatives) are right, and errors raise the client's own exception classes."""

from __future__ import annotations

import asyncio
import io
import json

import httpx
import openai
import pytest
from lorax import AsyncClient, Client, MergedAdapters
from lorax.errors import NotFoundError, UnknownError, ValidationError

from tests.e2e.compat_server import make_tenant
from tests.fixtures.peft_adapters import make_peft_adapter

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The `dict` method is deprecated")]  # lorax-client
PROMPT = "The quick brown fox"
N = 12


@pytest.fixture(scope="module")
def lx(compat_srv, compat_model_dir, tmp_path_factory):
    """(server, lorax Client, openai client, api key): tenant ``lorax`` with adapter ``tuned``."""
    from transformers import AutoModelForCausalLM

    srv = compat_srv
    key = make_tenant(srv, "lorax")
    base = AutoModelForCausalLM.from_pretrained(str(compat_model_dir))
    adapter = make_peft_adapter(base, tmp_path_factory.mktemp("lorax-adapter") / "tuned", seed=21)
    files = {name: (name, io.BytesIO((adapter / name).read_bytes()), "application/octet-stream")
             for name in ("adapter_config.json", "adapter_model.safetensors")}
    with srv.admin() as c:
        assert c.post("/admin/v1/tenants/lorax/adapters/tuned/versions", files=files).status_code in (200, 201)
    auth = {"Authorization": f"Bearer {key}"}
    oai = openai.OpenAI(base_url=f"{srv.url}/t/lorax/v1", api_key=key, max_retries=0, timeout=60)
    return srv, Client(f"{srv.url}/t/lorax", headers=auth, timeout=60), oai, key


def _visible(tokens) -> str:
    return "".join(t.text for t in tokens if not t.special)


@pytest.mark.parametrize("adapter", [None, "tuned", "tuned@1"])
def test_greedy_generate_equals_openai_completion(lx, adapter):
    _, client, oai, _ = lx
    out = client.generate(PROMPT, adapter_id=adapter, max_new_tokens=N)  # details: the client's default
    ref = oai.completions.create(model=adapter or "base-model", prompt=PROMPT, max_tokens=N, temperature=0)
    choice = ref.choices[0]
    assert out.generated_text == choice.text
    d = out.details
    assert d.finish_reason == {"length": "length", "stop": "eos_token"}[choice.finish_reason]
    assert (d.generated_tokens, d.prompt_tokens) == (ref.usage.completion_tokens, ref.usage.prompt_tokens)
    assert d.seed is None and d.prefill == [] and len(d.tokens) == d.generated_tokens
    assert _visible(d.tokens) == out.generated_text
    if adapter is not None:  # the adapter's weights, not the base model's
        assert out.generated_text != client.generate(PROMPT, max_new_tokens=N).generated_text


def test_stream_tokens_join_into_generated_text(lx):
    _, client, _, _ = lx
    whole = client.generate(PROMPT, adapter_id="tuned", max_new_tokens=N)
    events = list(client.generate_stream(PROMPT, adapter_id="tuned", max_new_tokens=N))
    *body, last = events
    assert all(e.generated_text is None and e.details is None for e in body)
    assert last.generated_text == _visible(e.token for e in events) == whole.generated_text
    assert [e.token.model_dump() for e in events] == [t.model_dump() for t in whole.details.tokens]
    assert last.details.finish_reason == whole.details.finish_reason
    assert last.details.generated_tokens == len(events) == whole.details.generated_tokens
    # and the async client (aiohttp), on the route where the key decides the tenant
    srv, _, _, key = lx
    async_client = AsyncClient(srv.url, headers={"Authorization": f"Bearer {key}"}, timeout=1)
    out = asyncio.run(async_client.generate(PROMPT, adapter_id="tuned", max_new_tokens=N))
    assert out.generated_text == whole.generated_text


def test_plain_http_shapes(lx):
    srv, client, _, key = lx
    body = {"inputs": PROMPT, "parameters": {"adapter_id": "tuned", "max_new_tokens": 4}}
    with srv.client(key) as http:
        r = http.post("/generate", json=body)
        assert r.status_code == 200 and set(r.json()) == {"generated_text"}  # details only when asked
        assert r.headers["x-adapter-id"] == "tuned" and r.headers["x-generated-tokens"] == "4"
        r = http.post("/t/lorax/generate_stream", json=body)
        events = [json.loads(line[5:]) for line in r.text.splitlines() if line.startswith("data:")]
        assert len(events) == 4 and all(set(e) == {"token", "generated_text", "details"} for e in events)
        assert all(set(e["token"]) == {"id", "text", "logprob", "special"} for e in events)
        assert events[-1]["generated_text"] == client.generate(PROMPT, adapter_id="tuned",
                                                               max_new_tokens=4).generated_text
        assert events[-1]["details"] is None


def test_stop_sequence_eos_and_response_format(lx):
    _, client, _, _ = lx
    text = client.generate(PROMPT, max_new_tokens=N, ignore_eos_token=True).generated_text
    stop = text[4:6]
    cut = text[: text.index(stop) + len(stop)]  # LoRAX keeps the stop sequence
    out = client.generate(PROMPT, max_new_tokens=N, ignore_eos_token=True, stop_sequences=[stop])
    assert (out.generated_text, out.details.finish_reason) == (cut, "stop_sequence")
    # structured output ends with EOS: "eos_token", the EOS token special and out of the text
    fmt = {"type": "json_object", "schema": {"type": "string", "enum": ["yes", "no"]}}
    out = client.generate(PROMPT, max_new_tokens=N, response_format=fmt)
    assert json.loads(out.generated_text) in ("yes", "no") and out.details.finish_reason == "eos_token"
    *_, eos = out.details.tokens
    assert (eos.id, eos.text, eos.special) == (1, "</s>", True)
    events = list(client.generate_stream(PROMPT, max_new_tokens=N, response_format=fmt))
    assert events[-1].generated_text == out.generated_text and events[-1].token.special
    assert events[-1].details.finish_reason == "eos_token"


def test_prefill_and_alternatives(lx):
    _, client, oai, _ = lx
    out = client.generate(PROMPT, max_new_tokens=3, decoder_input_details=True, return_k_alternatives=3)
    prefill = out.details.prefill
    assert [t.text for t in prefill] == list(PROMPT) and prefill[0].logprob is None
    echo = oai.completions.create(model="base-model", prompt=PROMPT, max_tokens=1, echo=True, logprobs=0, temperature=0)
    want = echo.choices[0].logprobs.token_logprobs[: len(PROMPT)]
    assert [t.logprob for t in prefill[1:]] == pytest.approx(want[1:], rel=1e-4, abs=1e-5)
    for token in out.details.tokens:  # greedy: the first alternative is the token itself
        alts = token.alternative_tokens
        assert len(alts) == 3 and [a.logprob for a in alts] == sorted((a.logprob for a in alts), reverse=True)
        assert alts[0].id == token.id and alts[0].text  # decoded alone (the token's own text may be ""
        # when it holds the first bytes of a character, which the token that completes it carries)
        assert alts[0].logprob == pytest.approx(token.logprob)


def test_sampling_seeds(lx):
    _, client, _, _ = lx
    a = client.generate(PROMPT, do_sample=True, seed=7, max_new_tokens=N, ignore_eos_token=True)
    b = client.generate(PROMPT, do_sample=True, seed=7, max_new_tokens=N, ignore_eos_token=True)
    assert a.generated_text == b.generated_text and a.details.seed == 7
    c = client.generate(PROMPT, temperature=0.9, max_new_tokens=N, ignore_eos_token=True)  # sampled, no seed
    assert isinstance(c.details.seed, int)
    again = client.generate(PROMPT, temperature=0.9, seed=c.details.seed, max_new_tokens=N, ignore_eos_token=True)
    assert again.generated_text == c.generated_text


@pytest.mark.parametrize("kwargs, error", [
    ({"adapter_id": "no-such-adapter"}, NotFoundError),
    ({"watermark": True}, ValidationError),
    ({"adapter_source": "hub", "adapter_id": "tuned"}, ValidationError),
    ({"typical_p": 0.5}, ValidationError),
    ({"best_of": 2, "do_sample": True}, ValidationError),
    ({"max_new_tokens": 10_000}, ValidationError),
])
def test_errors_raise_the_clients_exceptions(lx, kwargs, error):
    _, client, _, _ = lx
    with pytest.raises(error):
        client.generate(PROMPT, **kwargs)
    if "best_of" not in kwargs:
        with pytest.raises(error):
            list(client.generate_stream(PROMPT, **kwargs))


def test_info_and_tokenize_on_the_real_server(lx, compat_model_dir):
    """LoRAX's /info against the server's flags (--max-model-len 512, 4 per tenant) and the
    engine's real dtype and device; LoRAX's and vLLM's /tokenize against the model's own
    tokenizer, and vLLM's chat form against the prompt a chat completion runs. (lorax-client
    0.6.3 has no call for /info or /tokenize: plain HTTP.)"""
    from transformers import AutoTokenizer

    from tests.e2e.compat_server import MAX_CONCURRENT, MESSAGES

    srv, _, oai, key = lx
    tok = AutoTokenizer.from_pretrained(str(compat_model_dir))
    with srv.client(key) as http:
        info = http.get("/t/lorax/info").json()
        assert (info["model_id"], info["max_total_tokens"], info["max_input_length"]) == ("base-model", 512, 511)
        assert info["max_concurrent_requests"] == MAX_CONCURRENT
        assert info["model_dtype"] == "torch.float32" and info["model_device_type"] in ("cpu", "cuda")
        lorax = http.post("/t/lorax/tokenize", json={"inputs": PROMPT}).json()
        ids = tok(PROMPT)["input_ids"]
        assert [t["id"] for t in lorax] == ids and [t["text"] for t in lorax] == tok.convert_ids_to_tokens(ids)
        assert "".join(PROMPT[t["start"]:t["stop"]] for t in lorax) == PROMPT  # one token per byte, ASCII
        vllm = http.post("/t/lorax/tokenize", json={"model": "tuned", "prompt": PROMPT}).json()
        assert vllm["tokens"] == ids and vllm["max_model_len"] == 512
        assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": tok.decode(ids)}
        chat = http.post("/tokenize", json={"model": "tuned", "messages": MESSAGES}).json()
    ref = oai.chat.completions.create(model="tuned", messages=MESSAGES, max_tokens=1)
    assert chat["count"] == ref.usage.prompt_tokens
    assert chat["tokens"] == tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_merged_adapters_with_lorax_client(lx, compat_model_dir, tmp_path):
    """lorax-client's ``MergedAdapters`` (ties): the greedy tokens are those of PEFT's own merge
    of the two adapters (``add_weighted_adapter``), streamed and not; an unknown id is the
    client's NotFoundError."""
    import torch
    from transformers import AutoModelForCausalLM

    from loraplex.lora.peft_format import compute_content_hash
    from tests.fixtures.peft_adapters import peft_model_for

    srv, client, _, _ = lx
    base = AutoModelForCausalLM.from_pretrained(str(compat_model_dir), dtype=torch.float32).eval()
    # `tuned` made again as the fixture made it (its content hash proves it), and a second adapter
    dirs = {"tuned": make_peft_adapter(base, tmp_path / "tuned", seed=21),
            "other": make_peft_adapter(base, tmp_path / "other", seed=22)}
    with srv.admin() as c:
        versions = c.get("/admin/v1/tenants/lorax/adapters/tuned").json()["versions"]
        assert compute_content_hash(dirs["tuned"]) in {v["sha256"] for v in versions}
        files = {name: (name, io.BytesIO((dirs["other"] / name).read_bytes()), "application/octet-stream")
                 for name in ("adapter_config.json", "adapter_model.safetensors")}
        assert c.post("/admin/v1/tenants/lorax/adapters/other/versions", files=files).status_code in (200, 201)
    merged = MergedAdapters(ids=["tuned", "other"], weights=[0.7, 1.2], merge_strategy="ties", density=0.5,
                            majority_sign_method="total")
    out = client.generate(PROMPT, merged_adapters=merged, max_new_tokens=N, decoder_input_details=True)
    prompt = [t.id for t in out.details.prefill]
    tokens = [t.id for t in out.details.tokens]
    reference = peft_model_for(base, dirs)
    reference.add_weighted_adapter(["tuned", "other"], [0.7, 1.2], "m", combination_type="ties", density=0.5)
    reference.set_adapter("m")
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for want in tokens:
            nxt = int(reference(input_ids=ids).logits[0, -1].argmax())
            assert nxt == want
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    streamed = list(client.generate_stream(PROMPT, merged_adapters=merged, max_new_tokens=N))
    assert [e.token.id for e in streamed] == tokens and streamed[-1].generated_text == out.generated_text
    with pytest.raises(NotFoundError):
        client.generate(PROMPT, merged_adapters=MergedAdapters(ids=["tuned", "nope"], weights=[1, 1], density=0.0))


def test_bad_key(lx):
    srv = lx[0]
    with pytest.raises(UnknownError, match="401"):
        Client(f"{srv.url}/t/lorax", headers={"Authorization": "Bearer nope"}).generate(PROMPT)
    r = httpx.post(srv.url + "/generate", json={"inputs": PROMPT})
    assert r.status_code == 401 and r.json()["error_type"] == "authentication"


def test_access_log(lx):
    srv = lx[0]
    log = srv.log()
    records = [json.loads(line) for line in log.splitlines() if line.startswith('{"event":"request"')]
    mine = [r for r in records if r["endpoint"] == "generate"]
    assert any(r["tenant"] == "lorax" and r["adapter"] == "tuned" and r["status"] == 200 for r in mine)
    assert {r["status"] for r in mine if r["status"] != 200} <= {401, 404, 422}
    assert "Traceback" not in log
