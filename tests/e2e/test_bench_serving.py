"""benchmarks/bench_serving.py (serving_client.py, serving_server.py): its percentile and summary math against hand-computed figures, and
its load loop against a real ``loraplex serve`` process on a tiny random model (4 users)."""

from __future__ import annotations

import asyncio
import importlib
import math
import sys

import pytest

from tests.e2e.server_process import ADMIN_KEY, REPO_ROOT, start_server
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.fixtures.tiny_models import make_tiny_model_dir


def _bench_modules():
    """serving_client and serving_server, the two halves bench_serving.py imports from beside it."""
    benchmarks = str(REPO_ROOT / "benchmarks")
    if benchmarks not in sys.path:
        sys.path.insert(0, benchmarks)
    return importlib.import_module("serving_client"), importlib.import_module("serving_server")


client, server = _bench_modules()


def test_percentile_matches_hand_computed():
    xs = [0.4, 0.1, 0.3, 0.2]  # sorted: .1 .2 .3 .4; position (n - 1) * q / 100, linear between
    assert client.percentile(xs, 50) == pytest.approx(0.25)  # position 1.5
    assert client.percentile(xs, 90) == pytest.approx(0.37)  # 2.7: .3 + .7 * .1
    assert client.percentile(xs, 99) == pytest.approx(0.397)  # 2.97
    assert client.percentile(xs, 0) == 0.1 and client.percentile(xs, 100) == 0.4
    assert client.percentile([5.0], 99) == 5.0
    assert math.isnan(client.percentile([], 50))


def test_summary_counts_only_successes():
    S = client.Sample
    samples = [
        S("m", ok=True, ttft=0.1, itls=[0.01, 0.03], e2e=1.0, output_tokens=3, content_chunks=3),
        S("m", ok=True, ttft=0.3, itls=[0.02], e2e=2.0, output_tokens=3, content_chunks=2),
        S("m", ok=False, error="HTTP 429: busy", ttft=9.0, itls=[9.0], output_tokens=3),
        S("m", ok=False, error="HTTP 429: busy"),
    ]
    s = client.summarize(samples, wall_s=2.0)
    assert (s.ok, s.failed, s.output_tokens) == (2, 2, 6)
    assert s.tok_per_s == 3.0 and s.req_per_s == 1.0 and s.tokens_per_chunk == 6 / 5
    assert s.ttft["p50"] == pytest.approx(0.2) and s.ttft["p99"] == pytest.approx(0.298)
    assert s.itl["p50"] == pytest.approx(0.02) and s.itl["p90"] == pytest.approx(0.028)  # .02 + .8 * .01
    assert s.e2e["p99"] == pytest.approx(1.99) and s.itl["max"] == 0.03
    assert s.errors == {"HTTP 429: busy": 2}


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_load_loop_against_tiny_server(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = make_tiny_model_dir(tmp_path / "model", "llama", seed=3)
    base = AutoModelForCausalLM.from_pretrained(model_dir)
    dirs = [make_peft_adapter(base, tmp_path / f"a{i}", seed=i, r=4) for i in range(2)]
    srv = start_server(tmp_path / "home", model_dir, "--kv-cache-bytes", str(4 << 20), "--max-model-len", "256")
    try:
        key, names, base_name = server.setup_tenant(srv.url, ADMIN_KEY, dirs)
        assert (names, base_name) == (["a0", "a1"], "base-model")
        prompts = client.make_prompts(8, "t")
        assert len(set(prompts)) == 8
        run = asyncio.run(client.run_level(srv.url, key, [base_name, *names], prompts, 4, 16,
                                          extra_body={"skip_special_tokens": False}))
        assert [s.model for s in run.samples] == [base_name, "a0", "a1"] * 2 + [base_name, "a0"]
        good = [s for s in run.samples if s.ok]
        for s in run.samples:
            assert s.output_tokens == 16 and s.finish_reason == "length", s
            if not s.ok and s.error == "no content chunk":
                continue  # random weights: every sampled byte may belong to an unfinished UTF-8 character
            assert s.ok, s.error
            assert 0 < s.ttft <= s.e2e and len(s.itls) == s.content_chunks - 1
        assert len(good) >= 4 and run.health_s and run.wall_s > 0
        summary = client.summarize(run.samples, run.wall_s)
        assert (summary.ok, summary.output_tokens) == (len(good), 16 * len(good))
        ttfts = [s.ttft for s in good]
        assert summary.ttft["p90"] == pytest.approx(client.percentile(ttfts, 90))
        idle = server.idle_state(srv.url, ADMIN_KEY)
        assert idle["kv_cache_usage_perc"] == 0 and idle["num_blocks_free"] == idle["num_blocks_total"]
        records, _ = server.access_records(srv.log_path, 0)
        assert sum(r["status"] == 200 and r["completion_tokens"] == 16 for r in records) == 8
    finally:
        srv.stop()
