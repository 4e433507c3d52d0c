"""SGLang's /generate on the real engine (tiny Llama, CPU, a PEFT adapter behind the real
AdapterManager): greedy outputs equal the OpenAI completions route's for the same prompt and
adapter (the reference), single, batched with a lora_path per prompt, from token ids and
streamed; logprobs equal the completions route's; /flush_cache empties the prefix cache (the
engine's hit counter says so) and /health_generate runs a token."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from starlette.testclient import TestClient

from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.server.app import create_app
from tests.engine.test_engine_exact import tight_llm
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.server.registry_stack import registry_stack

ADMIN_KEY = "sglang-admin-key"
FILES = ("adapter_config.json", "adapter_model.safetensors")
TEXT = " ".join(f"word{i}" for i in range(40))  # several full blocks of 16 tokens


@pytest.fixture(scope="module")
def world(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("sglang")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    adapter = make_peft_adapter(base, root / "sql", seed=5, r=4, target_modules=["q_proj", "v_proj"])
    home = root / "home"
    llm = tight_llm(tiny_llama_dir, home, num_blocks=256, enable_prefix_caching=True, max_num_batched_tokens=512,
                    max_loras=2, max_lora_rank=8)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    stack = registry_stack(home, llm, tiny_llama_dir, ADMIN_KEY)
    try:
        with TestClient(create_app(stack.settings, engine=engine, registry=stack.registry, adapters=stack.manager)) as client:
            r = client.post("/admin/v1/tenants/acme/adapters/sql/versions",
                            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                            files={n: (n, (adapter / n).read_bytes()) for n in FILES})
            assert r.status_code == 201, r.text
            client.headers["Authorization"] = f"Bearer {stack.tenant_key}"
            yield client, llm.engine, engine
    finally:
        engine.shutdown()


def _completion(client, prompt, model: str | None, max_tokens: int = 6, **extra) -> dict:
    model = model or client.app.state.ctx.served_model_name
    r = client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                             "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def _generate(client, **body):
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _finish(choice: dict) -> str:
    """An OpenAI finish reason in SGLang's ``finish_reason.type`` words."""
    return "length" if choice["finish_reason"] == "length" else "stop"


@pytest.mark.parametrize("lora", ["sql", None])
def test_greedy_equals_completions(world, lora):
    client, *_ = world
    want = _completion(client, "The quick brown fox", lora)["choices"][0]
    got = _generate(client, text="The quick brown fox", lora_path=lora,
                    sampling_params={"temperature": 0, "max_new_tokens": 6})
    assert got["text"] == want["text"]
    assert got["meta_info"]["finish_reason"]["type"] == _finish(want)
    assert got["meta_info"]["completion_tokens"] == len(got["output_ids"])


def test_adapter_changes_the_output_and_batches_keep_theirs(world):
    client, *_ = world
    prompts = ["Once upon a time", "The quick brown fox", "Once upon a time"]
    loras = ["sql", None, None]
    want = [_completion(client, p, lora)["choices"][0]["text"] for p, lora in zip(prompts, loras)]
    assert want[0] != want[2]  # the adapter is live: otherwise this test could not fail
    got = _generate(client, text=prompts, lora_path=loras, sampling_params={"temperature": 0, "max_new_tokens": 6})
    assert [o["text"] for o in got] == want


def test_input_ids_and_stream(world):
    client, *_ = world
    ids = client.app.state.ctx.tokenizer("Hello there")["input_ids"]
    want = _completion(client, ids, "sql")["choices"][0]["text"]
    got = _generate(client, input_ids=ids, lora_path="sql", sampling_params={"temperature": 0, "max_new_tokens": 6})
    assert got["text"] == want and got["meta_info"]["prompt_tokens"] == len(ids)
    r = client.post("/generate", json={"input_ids": ids, "lora_path": "sql", "stream": True,
                                       "sampling_params": {"temperature": 0, "max_new_tokens": 6}})
    data = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    events = [json.loads(d) for d in data[:-1]]
    assert events[-1]["text"] == want and events[-1]["meta_info"]["finish_reason"] is not None
    assert all(want.startswith(e["text"]) for e in events)  # cumulative, as SGLang streams


def test_logprobs_equal_completions(world):
    client, *_ = world
    prompt = "The quick brown fox"
    ids = client.app.state.ctx.tokenizer(prompt)["input_ids"]
    ref = _completion(client, prompt, "sql", max_tokens=4, logprobs=2, prompt_logprobs=0)
    got = _generate(client, text=prompt, lora_path="sql", return_logprob=True, top_logprobs_num=2,
                    logprob_start_len=0, sampling_params={"temperature": 0, "max_new_tokens": 4})["meta_info"]
    ref_lp = ref["choices"][0]["logprobs"]["token_logprobs"]
    assert [e[0] for e in got["output_token_logprobs"]] == pytest.approx(ref_lp, abs=1e-5)
    assert [e[1] for e in got["output_token_logprobs"]] == got_ids(client, prompt)
    assert [len(top) for top in got["output_top_logprobs"]] == [2] * 4
    assert [top[0][0] >= top[1][0] for top in got["output_top_logprobs"]] == [True] * 4
    prompt_ref = ref["choices"][0]["prompt_logprobs"]  # vLLM puts a completion's on its choice
    assert [e[1] for e in got["input_token_logprobs"]] == ids
    assert got["input_token_logprobs"][0][0] is None and got["input_top_logprobs"][0] is None
    for i in range(1, len(ids)):
        assert got["input_token_logprobs"][i][0] == pytest.approx(prompt_ref[i][str(ids[i])]["logprob"], abs=1e-5)


def got_ids(client, prompt: str) -> list[int]:
    """The greedy output ids of the adapter, from the completions route's logprob tokens."""
    ref = _completion(client, prompt, "sql", max_tokens=4, logprobs=0, return_tokens_as_token_ids=True)
    return [int(t.split(":")[1]) for t in ref["choices"][0]["logprobs"]["tokens"]]


def test_flush_cache_empties_the_prefix_cache(world):
    client, engine, _ = world

    def hits() -> int:
        before = engine.stats()["prefix_cache_hits"]
        _generate(client, text=TEXT, sampling_params={"temperature": 0, "max_new_tokens": 2})
        return engine.stats()["prefix_cache_hits"] - before

    cold = hits()
    assert hits() > cold  # cached now
    r = client.post("/flush_cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200, r.text
    assert hits() == cold  # cold again
    assert client.get("/health_generate").status_code == 200


def test_a_busy_engine_keeps_its_cache(world):
    """SGLang's rule: with a request running or waiting the flush is refused (and done once idle)."""
    _, core, engine = world
    from loraplex.sampling_params import SamplingParams

    async def run() -> tuple[bool, bool]:
        stream = engine.generate([1, 2, 3], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                                 request_id="busy")
        await stream.__anext__()  # running now
        busy = await engine.flush_prefix_cache()
        async for _ in stream:
            pass
        return busy, await engine.flush_prefix_cache()

    assert asyncio.run(run()) == (False, True)
    assert not core.has_unfinished()


def test_server_info_reads_the_engines_step_budget(world):
    client, core, _ = world
    info = client.get("/get_server_info").json()
    cfg = core.config
    assert info["chunked_prefill_size"] == (cfg.max_num_batched_tokens if cfg.enable_chunked_prefill else -1)
    assert info["chunked_prefill_size"] == 512  # the budget this engine was built with
    assert info["disable_radix_cache"] is False


def test_n_greedy_samples_are_the_greedy_answer(world):
    client, *_ = world
    want = _completion(client, "The quick brown fox", None, max_tokens=4)["choices"][0]["text"]
    got = _generate(client, text="The quick brown fox", sampling_params={"n": 2, "temperature": 0,
                                                                        "max_new_tokens": 4})
    assert [o["text"] for o in got] == [want, want] and got[0]["meta_info"]["id"] != got[1]["meta_info"]["id"]


def test_select_scoring_as_sgl_function_sends_it(world):
    """sgl.function's RuntimeEndpoint.select: max_new_tokens 0 with return_logprob and
    logprob_start_len k, a batch of choices. Each answer is the prompt's logprobs from k (the
    first null, as SGLang pads it), no output; the logprobs equal the completions route's
    prompt_logprobs for the same adapter (the reference)."""
    client, *_ = world
    choices = ["The quick brown fox", "The quick brown dog"]
    start = 2
    got = _generate(client, text=choices, lora_path="sql", return_logprob=True, return_text_in_logprobs=True,
                    logprob_start_len=start, sampling_params={"max_new_tokens": 0, "temperature": 0})
    tok = client.app.state.ctx.tokenizer
    for prompt, out in zip(choices, got):
        ids = tok(prompt)["input_ids"]
        meta = out["meta_info"]
        assert (out["text"], out["output_ids"], meta["output_token_logprobs"]) == ("", [], [])
        assert meta["finish_reason"] == {"type": "length", "length": 0} and meta["completion_tokens"] == 0
        ref = _completion(client, prompt, "sql", max_tokens=1, prompt_logprobs=0)["choices"][0]["prompt_logprobs"]
        lps = meta["input_token_logprobs"]
        assert [e[1] for e in lps] == ids[start:]
        assert [e[2] for e in lps] == [tok.decode([t]) for t in ids[start:]]
        assert lps[0][0] is None  # SGLang: "Always pad the first one with None"
        for k, (lp, token, _) in enumerate(lps[1:], start + 1):
            assert lp == pytest.approx(ref[k][str(token)]["logprob"], abs=1e-5)


def test_ebnf_is_sglangs_gbnf(world):
    """SGLang's ``ebnf`` is xgrammar's GBNF (``root ::= ...``): enforced (it was a 400 asking for
    Lark), the output one of the grammar's strings, ended by EOS once the grammar completes."""
    client, *_ = world
    got = _generate(client, text="Is it?", sampling_params={"ebnf": 'root ::= "yes" | "no"', "max_new_tokens": 8})
    assert got["text"] in ("yes", "no")
    assert got["meta_info"]["finish_reason"]["type"] == "stop"
