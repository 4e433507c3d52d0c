"""benchmarks/bench_serving.py: its percentile and summary math against hand-computed figures, and
its load loop against a real ``loraplex serve`` process on a tiny random model (4 users)."""

from __future__ import annotations

import asyncio
import importlib.util
import math
import sys
from pathlib import Path

import pytest

from tests.e2e.server_process import ADMIN_KEY, REPO_ROOT, start_server
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.fixtures.tiny_models import make_tiny_model_dir


def _bench():
    spec = importlib.util.spec_from_file_location("bench_serving", REPO_ROOT / "benchmarks" / "bench_serving.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _bench()


def test_percentile_matches_hand_computed():
    xs = [0.4, 0.1, 0.3, 0.2]  # sorted: .1 .2 .3 .4; position (n - 1) * q / 100, linear between
    assert bench.percentile(xs, 50) == pytest.approx(0.25)  # position 1.5
    assert bench.percentile(xs, 90) == pytest.approx(0.37)  # 2.7: .3 + .7 * .1
    assert bench.percentile(xs, 99) == pytest.approx(0.397)  # 2.97
    assert bench.percentile(xs, 0) == 0.1 and bench.percentile(xs, 100) == 0.4
    assert bench.percentile([5.0], 99) == 5.0
    assert math.isnan(bench.percentile([], 50))


def test_summary_counts_only_successes():
    S = bench.Sample
    samples = [
        S("m", ok=True, ttft=0.1, itls=[0.01, 0.03], e2e=1.0, output_tokens=3, content_chunks=3),
        S("m", ok=True, ttft=0.3, itls=[0.02], e2e=2.0, output_tokens=3, content_chunks=2),
        S("m", ok=False, error="HTTP 429: busy", ttft=9.0, itls=[9.0], output_tokens=3),
        S("m", ok=False, error="HTTP 429: busy"),
    ]
    s = bench.summarize(samples, wall_s=2.0)
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
        key, names, base_name = bench.setup_tenant(srv.url, ADMIN_KEY, dirs)
        assert (names, base_name) == (["a0", "a1"], "base-model")
        prompts = bench.make_prompts(8, "t")
        assert len(set(prompts)) == 8
        run = asyncio.run(bench.run_level(srv.url, key, [base_name, *names], prompts, 4, 16,
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
        summary = bench.summarize(run.samples, run.wall_s)
        assert (summary.ok, summary.output_tokens) == (len(good), 16 * len(good))
        ttfts = [s.ttft for s in good]
        assert summary.ttft["p90"] == pytest.approx(bench.percentile(ttfts, 90))
        idle = bench.idle_state(srv.url, ADMIN_KEY)
        assert idle["kv_cache_usage_perc"] == 0 and idle["num_blocks_free"] == idle["num_blocks_total"]
        records, _ = bench.access_records(srv.log_path, 0)
        assert sum(r["status"] == 200 and r["completion_tokens"] == 16 for r in records) == 8
    finally:
        srv.stop()
