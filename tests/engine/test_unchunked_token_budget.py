"""Without chunked prefill a prompt runs whole in one step, so the step budget
(``max_num_batched_tokens``) must hold the longest context. The reference is vLLM's rule
(vllm/config/scheduler.py ``verify_max_model_len``, identical from 0.15 on; its docs' warning,
vllm-project/vllm#33109): left out, the budget is ``max(max_model_len, 2048)``; given below
``max_model_len`` the engine does not start. loraplex used to keep 2048 and refuse each longer
prompt with a 400, so ``--no-enable-chunked-prefill`` on a long-context model served less than
vLLM does with the same command line."""

from __future__ import annotations

import pytest
import torch

from loraplex.config import EngineConfig, unchunked_token_budget
from loraplex.engine.llm import LLM
from loraplex.sampling_params import SamplingParams
from tests.fixtures.tiny_models import make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def long_llama(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("llama-long"), "llama", seed=3,
                               max_position_embeddings=4096)


def engine(model_dir, home, **options) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", device="cpu", home=home, max_num_seqs=2,
               kv_cache_bytes=64 * 2**20, **options)


def test_the_budget_rule_is_vllms():
    assert unchunked_token_budget(None, 100) == 2048
    assert unchunked_token_budget(None, 3000) == 3000
    assert unchunked_token_budget(4000, 3000) == 4000
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(2048\) is smaller than max_model_len \(3000\)"):
        unchunked_token_budget(2048, 3000)
    # with chunked prefill the budget stays vLLM's 2048 whatever the context
    assert EngineConfig().max_num_batched_tokens == 2048
    assert EngineConfig(enable_chunked_prefill=False).max_num_batched_tokens is None  # the engine sets it


def test_a_prompt_longer_than_2048_runs_whole_without_chunked_prefill(long_llama, tmp_path):
    prompt = torch.randint(4, 300, (2300,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = engine(long_llama, tmp_path / "a", max_model_len=2600, enable_chunked_prefill=False)
    assert whole.engine.config.max_num_batched_tokens == 2600
    out = whole.generate([prompt], GREEDY)[0].outputs[0].token_ids
    # the same greedy tokens as the chunked engine computes 2048 + 252 tokens
    chunked = engine(long_llama, tmp_path / "b", max_model_len=2600)
    assert chunked.engine.config.max_num_batched_tokens == 2048
    assert out == chunked.generate([prompt], GREEDY)[0].outputs[0].token_ids and len(out) == 3


def test_a_budget_below_the_context_stops_the_start(long_llama, tmp_path):
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) is smaller than max_model_len \(128\)"):
        engine(long_llama, tmp_path / "a", max_model_len=128, max_num_batched_tokens=64, enable_chunked_prefill=False)
    kept = engine(long_llama, tmp_path / "b", max_model_len=128, max_num_batched_tokens=200,
                  enable_chunked_prefill=False)
    assert kept.engine.config.max_num_batched_tokens == 200


def test_one_budget_everywhere_the_engine_reads_it(long_llama, tmp_path):
    """The budget the engine works out (vLLM's rule: max(max_model_len, 2048) when left out) is the
    one config every part reads: the engine, its runner, scheduler and LoRA manager, ``LLM.config``,
    the async engine, and ``/admin/v1/status``. The runner used to keep the config it was built
    with (budget None) while the scheduler ran with 2600."""
    from loraplex.engine.async_engine import AsyncLLMEngine
    from tests.server.conftest import start_server

    llm = engine(long_llama, tmp_path / "home", max_model_len=2600, enable_chunked_prefill=False)
    core = llm.engine
    expected = max(2600, 2048)  # vllm/config/scheduler.py: the unchunked default
    assert core.runner.config is core.config is core.scheduler.config is llm.config
    assert core.lora_manager.config is core.config
    assert core.config.max_num_batched_tokens == expected
    assert core.stats()["max_num_batched_tokens"] == expected
    server = start_server(tmp_path / "srv", engine=AsyncLLMEngine(llm.config, engine=core))
    try:
        assert server.engine.config is core.config
        with server.admin() as admin:
            status = admin.get("/admin/v1/status").json()
        assert status["engine"]["max_num_batched_tokens"] == expected
        assert status["max_model_len"] == core.max_model_len == core.runner.max_model_len == 2600
    finally:
        server.stop()
