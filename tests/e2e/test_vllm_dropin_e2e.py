"""End to end: a ``vllm serve``-style command line (positional model, ``--enable-lora``,
``--lora-modules`` in both forms, ``--api-key``) on the real ``loraplex serve`` process, called
by the official openai client with that key and the adapter's name, checked against the offline
engine with the same PEFT directory; the key appears nowhere in the server's output."""

from __future__ import annotations

import json
import os

import openai
import pytest

from loraplex.sampling_params import SamplingParams
from tests.e2e.server_process import start_server
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.fixtures.tiny_models import make_tiny_model_dir

pytestmark = pytest.mark.slow

KEY = "sk-dropin-team-2026"
MAX_MODEL_LEN = 256
KV_BYTES = 4 << 20


def test_a_vllm_command_line_and_client_run_unchanged(tmp_path):
    from transformers import AutoModelForCausalLM

    from loraplex import LLM

    model_dir = make_tiny_model_dir(tmp_path / "model", "llama", seed=3)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    sql = make_peft_adapter(base, tmp_path / "adapters" / "sql", seed=21)
    chat = make_peft_adapter(base, tmp_path / "adapters" / "chat", seed=22, r=8)
    srv = start_server(
        tmp_path / "home", model_dir, str(model_dir), "--enable-lora",
        "--lora-modules", f"sql={sql}", json.dumps({"name": "chat", "path": str(chat), "base_model_name": "m"}),
        "--api-key", KEY, "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-bytes", str(KV_BYTES),
    )
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        assert {"sql", "chat"} <= {m.id for m in client.models.list().data}
        messages = [{"role": "user", "content": "SELECT the answer"}]
        got = client.chat.completions.create(model="sql", messages=messages, max_tokens=12, temperature=0)
        assert got.model == "sql"

        llm = LLM(model=str(model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
                  kv_cache_bytes=KV_BYTES)
        llm.add_adapter("sql", str(sql))
        want = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0), adapters=["sql"])[0].outputs[0]
        assert got.choices[0].message.content == want.text
        assert got.usage.completion_tokens == len(want.token_ids)
        plain = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
        assert plain.text != want.text  # the adapter mattered: the comparison means something

        wrong = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sk-wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
    finally:
        srv.stop()
    log = srv.log()
    assert "--lora-modules sql: default/sql@1 (new version, now active)" in log
    assert KEY not in log  # neither printed at start nor in any request line


# a production-stack / KServe style launch: engine flags on the command line, the rest in vLLM's
# --config file, the command line winning where both say something
LAUNCH_CONFIG = """\
max-loras: 2
max-lora-rank: 16
max-num-seqs: 32
max-model-len: 128
enable-chunked-prefill: true
kv-cache-dtype: auto
api-key: [{key}]
lora-modules:
  - {{"name": "sql", "path": "{sql}"}}
"""


def test_a_production_vllm_launch_with_a_config_file_serves_chat(tmp_path):
    from transformers import AutoModelForCausalLM

    from loraplex import LLM

    model_dir = make_tiny_model_dir(tmp_path / "model", "llama", seed=5)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    sql = make_peft_adapter(base, tmp_path / "adapters" / "sql", seed=31)
    config = tmp_path / "vllm.yaml"
    config.write_text(LAUNCH_CONFIG.format(key=KEY, sql=sql))
    srv = start_server(
        tmp_path / "home", model_dir, str(model_dir), "--config", str(config),
        "--max-model-len", str(MAX_MODEL_LEN),  # wins over the file's 128
        "--kv-cache-bytes", str(KV_BYTES), "--tokenizer", str(model_dir), "--tokenizer-mode", "auto",
        "--pipeline-parallel-size", "1", "--data-parallel-size", "1", "--swap-space", "4",
        "--max-seq-len-to-capture", "8192", "--disable-log-stats", "--enable-log-requests",
        "--no-enable-prefix-caching", "--task", "generate", "-O3", "--load-format", "auto",
        "--limit-mm-per-prompt", '{"image": 0}', "--disable-custom-all-reduce", "--revision", "main",
        "--enforce-eager", "--log-level", "info",
    )
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        messages = [{"role": "user", "content": "SELECT the answer"}]
        got = client.chat.completions.create(model="sql", messages=messages, max_tokens=10, temperature=0)
        llm = LLM(model=str(model_dir), dtype="float32", device="cpu", max_model_len=MAX_MODEL_LEN,
                  kv_cache_bytes=KV_BYTES, enable_prefix_caching=False)
        llm.add_adapter("sql", str(sql))
        want = llm.chat(messages, SamplingParams(max_tokens=10, temperature=0), adapters=["sql"])[0].outputs[0]
        assert got.choices[0].message.content == want.text
        status = srv.admin().get("/admin/v1/status").json()
        assert status["max_model_len"] == MAX_MODEL_LEN  # the command line's, not the file's
    finally:
        srv.stop()
    log = srv.log()
    # kv-cache-dtype is loraplex's own flag now (fp8 KV cache): the file's key is read, not noted as vLLM's
    for flag in ("--swap-space", "--tokenizer:", "-O / --optimization-level"):
        assert f"vLLM flag taken: {flag}" in log, flag
    assert KEY not in log


def test_a_reasoning_parser_without_single_token_tags_stops_the_start(tmp_path):
    import subprocess
    import sys

    from tests.e2e.server_process import REPO_ROOT

    model_dir = make_tiny_model_dir(tmp_path / "model", "llama")  # byte-level: <think> is 7 tokens
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(LORAPLEX_HOME=str(tmp_path / "home"), LORAPLEX_ADMIN_KEY="k", OMP_NUM_THREADS="1",
               PYTHONPATH=str(REPO_ROOT))
    done = subprocess.run(
        [sys.executable, "-m", "loraplex.cli", "serve", str(model_dir), "--device", "cpu", "--dtype", "float32",
         "--port", "0", "--kv-cache-bytes", str(KV_BYTES), "--max-model-len", "64", "--reasoning-parser", "qwen3"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=240)
    assert done.returncode == 3  # uvicorn's exit status for a failed startup
    assert "--reasoning-parser qwen3: <think> is not one token of the model's tokenizer" in done.stdout + done.stderr
