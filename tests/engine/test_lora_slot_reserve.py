"""On CUDA the KV budget leaves room for the LoRA slot pool, which is allocated at the first
adapter load, after the cache: the reserve equals what ``SlotPool`` allocates with every stack in
use (every layer module and both vocabulary targets), counted off every tensor the pool holds
(scalings and ranks too), so that first load cannot run out of memory. On CPU the cache's cap is a
choice and the pool comes from RAM beside it: no reserve."""

from __future__ import annotations

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.engine import model_runner
from loraplex.engine.model_runner import ModelRunner
from loraplex.lora.slots import SlotPool
from loraplex.lora.spec import VOCAB_TARGETS
from tests.fixtures.tiny_models import make_tiny_model_dir

BLOCK = 4
RANK = 8


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("reserve-llama"), "llama", seed=3)


def _runner(model_dir, home, **options) -> ModelRunner:
    return ModelRunner(EngineConfig(**{"model": str(model_dir), "home": home, "block_size": BLOCK,
                                       "max_lora_rank": RANK, "max_num_seqs": 10_000, **options}))


def held_tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of every distinct tensor reachable from ``obj``'s attributes, lists and dicts (the
    slot pool's spec left out): what the pool holds, found without asking the pool."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if id(obj) in seen:
            return 0
        seen.add(id(obj))
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(held_tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(held_tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        return sum(held_tensor_bytes(v, seen) for k, v in vars(obj).items() if k != "spec")
    return 0


def _pool_bytes_in_use(runner: ModelRunner, max_loras: int) -> int:
    """Bytes a slot pool of ``max_loras`` slots holds once every stack is allocated."""
    pool = SlotPool(runner.lora_target_spec(), max_loras, RANK, runner.device, runner.dtype)
    pool._allocate()
    for module in VOCAB_TARGETS:
        pool.vocab.allocate(module)
    return held_tensor_bytes(pool)


def test_reserve_is_what_the_slot_pool_allocates(llama_dir, loraplex_home):
    runner = _runner(llama_dir, loraplex_home, max_loras=4, kv_cache_bytes=1 << 20)
    assert runner.lora_slot_bytes() == _pool_bytes_in_use(runner, 4)
    one_slot = _runner(llama_dir, loraplex_home, max_loras=1, kv_cache_bytes=1 << 20)
    assert runner.lora_slot_bytes() == 4 * one_slot.lora_slot_bytes()


def test_device_budget_leaves_the_reserve(llama_dir, loraplex_home):
    runner = _runner(llama_dir, loraplex_home, max_loras=9, kv_cache_bytes=1 << 20)
    budget = 50 * runner.lora_slot_bytes()
    left = runner._leave_lora_slots(budget)
    assert left == budget - _pool_bytes_in_use(runner, 9)
    with pytest.raises(ValueError, match="LoRA slot pool .* lower max_loras or max_lora_rank"):
        runner._leave_lora_slots(runner.lora_slot_bytes())


def test_cpu_budget_and_given_bytes_are_the_cache_alone(llama_dir, loraplex_home, monkeypatch):
    monkeypatch.setattr(model_runner, "CPU_KV_CAP_BYTES", 8 << 20)
    few, many = _runner(llama_dir, loraplex_home, max_loras=1), _runner(llama_dir, loraplex_home, max_loras=64)
    assert few.num_blocks == many.num_blocks
    given = _runner(llama_dir, loraplex_home, max_loras=64, kv_cache_bytes=1 << 20)
    assert given.num_blocks == (1 << 20) // given.kv_bytes_per_page


def test_figure_is_the_pools_own_dtype_on_cpu(llama_dir, loraplex_home):
    """The start-up line's pool figure on a bfloat16 CPU engine: its stacks are fp32 there (CPU
    bf16 matmuls are slow), so the figure is what that engine's own pool holds, not half of it."""
    from loraplex.engine.llm import LLM

    llm = LLM(model=str(llama_dir), dtype="bfloat16", device="cpu", home=loraplex_home, block_size=BLOCK,
              max_lora_rank=RANK, max_loras=3, kv_cache_bytes=1 << 20)
    pool = llm.engine.lora_manager.pool
    pool._allocate()
    for module in VOCAB_TARGETS:
        pool.vocab.allocate(module)
    assert llm.engine.runner.lora_slot_bytes() == held_tensor_bytes(pool)
