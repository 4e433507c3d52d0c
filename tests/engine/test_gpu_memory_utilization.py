"""``gpu_memory_utilization`` (vLLM's ``--gpu-memory-utilization``) on figures that model an H200
(141 GiB) serving an 8B model in bf16 (16 GiB of weights), checked against vLLM v1's rule written
out here by hand (vllm/v1/worker/gpu_worker.py: ``requested_memory = total * utilization``, a
start with less free refused, the KV cache gets the requested memory less the process's own
non-KV memory): the process never holds more than ``utilization * total``, two processes at 0.45
both fit, a busy GPU is refused before the weights load. No GPU: ``torch.cuda.mem_get_info`` is
replaced by a model of the device's memory."""

from __future__ import annotations

import logging

import pytest
import torch

from loraplex.config import GiB, EngineConfig
from loraplex.engine import model_runner
from loraplex.engine.kv_budget import DeviceMemory, check_free_at_start, memory_at_start, utilization_budget
from loraplex.engine.model_runner import ModelRunner
from tests.fixtures.tiny_models import make_tiny_model_dir

TOTAL = 141 * GiB  # an H200
WEIGHTS = 16 * GiB  # an 8B model in bf16
CONTEXT = GiB // 2  # the CUDA context and other processes' crumbs before anything loads
HEADROOM_SHARE = 0.1  # of what utilization leaves after the weights: activations (the default rule's split)


class FakeGPU:
    """One GPU's memory: what each process holds; ``mem_get_info`` as CUDA reports it."""

    def __init__(self, total: int = TOTAL):
        self.total = total
        self.held: dict[str, int] = {}

    def take(self, who: str, nbytes: int) -> None:
        self.held[who] = self.held.get(who, 0) + nbytes
        assert sum(self.held.values()) <= self.total, f"{who}: out of memory"

    def info(self) -> DeviceMemory:
        return DeviceMemory(free=self.total - sum(self.held.values()), total=self.total)


def start_process(gpu: FakeGPU, who: str, utilization: float, slot_pool: int = 0) -> int:
    """One loraplex start on ``gpu``: the start check, the weights, then the KV cache and the LoRA
    slot pool it sizes for; returns the KV cache's bytes."""
    gpu.take(who, CONTEXT)
    at_start = gpu.info()
    check_free_at_start(utilization, at_start, "cuda:0")
    gpu.take(who, WEIGHTS)
    budget = utilization_budget(utilization, at_start, gpu.info())
    kv = budget.nbytes - slot_pool
    gpu.take(who, kv + slot_pool)
    return kv


def test_one_process_gets_vllms_requested_memory_less_the_weights_and_headroom():
    gpu = FakeGPU()
    gpu.take("cuda context", CONTEXT)  # already there when the process measures
    at_start = gpu.info()
    gpu.take("me", WEIGHTS)
    budget = utilization_budget(0.9, at_start, gpu.info())
    # vLLM: 0.9 * 141 GiB = 126.9 GiB requested; less 16 GiB of weights = 110.9 GiB, of which
    # loraplex keeps 10% for activations (vLLM would subtract its profiled activation peak)
    assert budget.nbytes == pytest.approx((0.9 * 141 - 16) * (1 - HEADROOM_SHARE) * GiB, abs=1)
    assert "gpu_memory_utilization 0.9" in budget.rule and "126.90 GiB" in budget.rule


def test_two_processes_at_045_both_fit_one_after_the_other():
    gpu = FakeGPU()
    first = start_process(gpu, "a", 0.45)
    second = start_process(gpu, "b", 0.45)
    assert first == second == pytest.approx((0.45 * 141 - 16) * (1 - HEADROOM_SHARE) * GiB, abs=1)
    for who in "ab":  # each holds at most its 45%, context included, headroom left unallocated
        assert gpu.held[who] <= 0.45 * TOTAL
    assert sum(gpu.held.values()) <= 0.9 * TOTAL
    for who in "ab":  # both then run a step whose activations take all of their headroom
        gpu.take(who, int((0.45 * TOTAL - WEIGHTS) * HEADROOM_SHARE))  # FakeGPU: no OOM
        # U of the total, plus the CUDA context it had before measuring (outside U in vLLM too)
        assert gpu.held[who] <= 0.45 * TOTAL + CONTEXT


def test_two_processes_at_045_started_together_both_fit():
    """Both measure free memory before either loads; each then counts the other's weights as its
    own (free before less free after), so each sizes smaller, never larger."""
    gpu = FakeGPU()
    starts = {}
    for who in "ab":
        gpu.take(who, CONTEXT)
    for who in "ab":
        starts[who] = gpu.info()
        check_free_at_start(0.45, starts[who], "cuda:0")
    for who in "ab":
        gpu.take(who, WEIGHTS)
    for who in "ab":
        gpu.take(who, utilization_budget(0.45, starts[who], gpu.info()).nbytes)
        assert gpu.held[who] <= 0.45 * TOTAL + CONTEXT


def test_a_busy_gpu_is_refused_in_vllms_words():
    gpu = FakeGPU()
    gpu.take("someone else", 80 * GiB)
    with pytest.raises(ValueError) as err:
        start_process(gpu, "me", 0.9)
    message = str(err.value)
    # vLLM's: "Free memory on device cuda:0 (60.50/141.00 GiB) on startup is less than desired GPU
    # memory utilization (0.9, 126.90 GiB). Decrease GPU memory utilization or reduce ..."
    assert "Free memory on device cuda:0 (60.50/141.00 GiB) on startup" in message
    assert "less than desired GPU memory utilization (0.9, 126.90 GiB)" in message
    assert "reduce GPU memory used by other processes" in message


def test_utilization_below_the_weights_is_refused_naming_both():
    gpu = FakeGPU()
    at_start = gpu.info()
    gpu.take("me", WEIGHTS)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0\.1 .* holds 16\.00 GiB"):
        utilization_budget(0.1, at_start, gpu.info())


def test_never_more_than_the_default_rule_when_memory_went_while_loading():
    gpu = FakeGPU()
    at_start = gpu.info()
    gpu.take("me", WEIGHTS)
    gpu.take("late neighbour", 100 * GiB)  # counted as this process's: smaller, never larger
    after = gpu.info()
    budget = utilization_budget(0.9, at_start, after)
    assert budget.nbytes <= int(after.free * 0.9)  # the default rule's figure
    # vLLM's figure less what the neighbour took, of which 10% is headroom
    assert budget.nbytes == pytest.approx((0.9 * 141 - 16 - 100) * (1 - HEADROOM_SHARE) * GiB, abs=1)


@pytest.mark.parametrize("utilization", [0.2, 0.45, 0.9, 1.0])
@pytest.mark.parametrize("others", [0, 5 * GiB, 60 * GiB])
def test_never_more_than_the_default_rule(utilization, others):
    gpu = FakeGPU()
    gpu.take("other", others)
    at_start = gpu.info()
    if at_start.free < utilization * TOTAL:
        return  # refused at start (test above)
    gpu.take("me", WEIGHTS)
    after = gpu.info()
    assert utilization_budget(utilization, at_start, after).nbytes <= int(after.free * 0.9)


@pytest.mark.parametrize("options,match", [
    ({"gpu_memory_utilization": 0}, r"must be in \(0, 1\]"),
    ({"gpu_memory_utilization": 1.01}, r"must be in \(0, 1\]"),
])
def test_bad_values_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**options)


# ---- through the model runner, on a modelled GPU ----------------------------------------------

BLOCK = 4


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("gpu-util-llama"), "llama", seed=5)


def _runner(model_dir, home, **options) -> ModelRunner:
    return ModelRunner(EngineConfig(model=str(model_dir), home=home, block_size=BLOCK, max_lora_rank=8,
                                    max_loras=2, **options))


def _fake_mem_get_info(monkeypatch, gpu: FakeGPU) -> None:
    def mem_get_info(device=None):
        info = gpu.info()
        return info.free, info.total

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)


def test_runner_sizes_on_cuda_by_utilization_less_the_slot_pool(llama_dir, loraplex_home, monkeypatch, caplog):
    """The runner's CUDA branch on a modelled H200: the start figures it measured before its
    weights, the figures after, and the LoRA slot pool left out as with the default rule."""
    runner = _runner(llama_dir, loraplex_home, kv_cache_bytes=1 << 20)  # built on CPU
    gpu = FakeGPU()
    gpu.take("me", CONTEXT)
    runner.memory_at_start = gpu.info()
    gpu.take("me", WEIGHTS)
    _fake_mem_get_info(monkeypatch, gpu)
    runner.device = torch.device("cuda")  # only the budget's branch and the pool's dtype read it
    runner.config = runner.config.replace(kv_cache_bytes=None, gpu_memory_utilization=0.45)
    reserve = runner.lora_slot_bytes()
    with caplog.at_level(logging.INFO, logger="loraplex.engine.model_runner"):
        budget = runner._kv_budget_bytes()
    expected = int((0.45 * 141 - 16) * GiB * (1 - HEADROOM_SHARE)) - reserve
    assert budget == pytest.approx(expected, abs=2)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV budget:"))
    assert "gpu_memory_utilization 0.45" in line and "less the LoRA slot pool" in line
    # a byte size given beside it sizes the cache, as vLLM's --kv-cache-memory-bytes does
    runner.config = runner.config.replace(kv_cache_bytes=3 << 20)
    assert runner._kv_budget_bytes() == 3 << 20
    runner.config = runner.config.replace(kv_cache_bytes=None)
    # a slot pool larger than what utilization leaves is refused as with the default rule
    runner.config = runner.config.replace(gpu_memory_utilization=0.12)  # 0.92 GiB past the weights
    runner.config = runner.config.replace(max_loras=runner.config.max_loras * (GiB // reserve + 1))
    with pytest.raises(ValueError, match="the LoRA slot pool .* needs .* raise gpu_memory_utilization"):
        runner._kv_budget_bytes()


def test_a_cache_too_small_names_the_option_that_sized_it(llama_dir, loraplex_home):
    """max_model_len beyond the cache: the advice names the option in force. With utilization
    given on a GPU that is gpu_memory_utilization (kv_cache_memory_fraction, which the message
    named, changes nothing then); the default rule's fraction; a byte size's bytes."""
    runner = _runner(llama_dir, loraplex_home)
    runner.device = torch.device("cuda")  # only the option's choice reads it here
    runner.num_blocks = 1
    for options, option in (({"gpu_memory_utilization": 0.45}, "gpu_memory_utilization"),
                            ({}, "kv_cache_memory_fraction"), ({"kv_cache_bytes": 1 << 20}, "kv_cache_bytes"),
                            ({"kv_cache_bytes": 1 << 20, "gpu_memory_utilization": 0.45}, "kv_cache_bytes")):
        runner.config = runner.config.replace(**{"max_model_len": runner.max_model_len, "kv_cache_bytes": None,
                                                 "gpu_memory_utilization": None, **options})
        with pytest.raises(ValueError, match="does not fit the KV cache") as refused:
            runner._limit_max_model_len_to_kv()
        assert f"raise {option} or lower max_model_len" in str(refused.value)
    runner.device = torch.device("cpu")  # on CPU utilization changes nothing: the fraction sizes it
    runner.config = runner.config.replace(kv_cache_bytes=None, gpu_memory_utilization=0.45)
    with pytest.raises(ValueError, match="raise kv_cache_memory_fraction or lower max_model_len"):
        runner._limit_max_model_len_to_kv()


def test_busy_gpu_is_refused_before_the_weights_load(monkeypatch):
    gpu = FakeGPU()
    gpu.take("someone else", 100 * GiB)
    _fake_mem_get_info(monkeypatch, gpu)
    with pytest.raises(ValueError, match="on startup is less than desired GPU memory utilization"):
        memory_at_start(torch.device("cuda:0"), 0.45)
    assert memory_at_start(torch.device("cuda:0"), None) == gpu.info()  # the default rule: no check
    assert memory_at_start(torch.device("cpu"), 0.45) is None


def test_cpu_takes_it_and_logs_that_the_cpu_cap_applies(llama_dir, loraplex_home, monkeypatch, caplog):
    monkeypatch.setattr(model_runner, "CPU_KV_CAP_BYTES", 8 << 20)
    plain = _runner(llama_dir, loraplex_home)
    with caplog.at_level(logging.INFO, logger="loraplex.engine.model_runner"):
        given = _runner(llama_dir, loraplex_home, gpu_memory_utilization=0.45)
    assert given.num_blocks == plain.num_blocks  # the cap's fraction, as without it
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV budget:"))
    assert "gpu_memory_utilization 0.45 has no GPU to size on CPU, the CPU cap applies" in line
