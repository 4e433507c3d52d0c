"""End to end: a launch command written for a recent ``vllm serve`` (flags that loraplex takes from
its table of vLLM's flags, vLLM's dotted JSON flags on the command line and in ``--config``) starts
the real ``loraplex serve`` process, which logs why each taken flag changes nothing and answers a
chat as the offline engine does with the same greedy settings."""

from __future__ import annotations

import openai
import pytest

from loraplex.sampling_params import SamplingParams
from tests.e2e.server_process import start_server
from tests.fixtures.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.slow

KEY = "sk-flag-table-2026"
MAX_MODEL_LEN = 256
KV_BYTES = 4 << 20

CONFIG = """\
compilation-config.cudagraph_capture_sizes: [1, 2, 4]
speculative-config:
  method: ngram
  num_speculative_tokens: 3
"""


def test_a_recent_vllm_launch_with_dotted_flags_serves_chat(tmp_path):
    from loraplex import LLM

    model_dir = make_tiny_model_dir(tmp_path / "model", "llama", seed=7)
    config = tmp_path / "vllm.yaml"
    config.write_text(CONFIG)
    srv = start_server(
        tmp_path / "home", model_dir, str(model_dir), "--config", str(config),
        # merged into one --speculative-config, which replaces the file's (the command line wins, as in vLLM)
        "--speculative-config.prompt_lookup_max", "2",
        "--speculative-config.method", "ngram", "--speculative_config.num_speculative_tokens=2",
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_BYTES),
        "-O.cudagraph_mode", "NONE", "--attention-backend", "FLASHINFER", "--prefix-caching-hash-algo", "sha256_cbor",
        "--disable-cascade-attn", "--mm-processor-cache-gb", "0", "--enable-expert-parallel",
        "--hf-config-path", str(model_dir), "--safetensors-load-strategy", "lazy", "-asc", "1",
        "--logprobs-mode", "raw_logprobs", "--max_num_partial_prefills", "1", "--h11-max-incomplete-event-size", "4194304",
        "--api-key", KEY, "--log-level", "info",
    )
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "count: one two three one two three one two"}]
        got = client.chat.completions.create(model="base-model", messages=messages,
                                             max_tokens=16, temperature=0)
        # greedy n-gram speculation leaves outputs as without it: the offline engine, no speculation
        llm = LLM(model=str(model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
                  kv_cache_bytes=KV_BYTES)
        want = llm.chat(messages, SamplingParams(max_tokens=16, temperature=0))[0].outputs[0]
        assert got.choices[0].message.content == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
        # the dotted --speculative-config ran: the repeated prompt gave the n-gram drafter drafts
        metrics = srv.admin().get("/metrics").text
        drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_drafts_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0, drafts
    finally:
        srv.stop()
    log = srv.log()
    for flag in ("--kv-cache-memory-bytes", "--compilation-config", "--attention-backend", "--enable-expert-parallel",
                 "--hf-config-path", "--logprobs-mode", "--max-num-partial-prefills"):
        assert f"vLLM flag taken: {flag}" in log, flag
