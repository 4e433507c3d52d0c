"""vLLM's ``max_cpu_loras`` (a count of adapters in the CPU cache) becomes a host byte budget: room
for that many adapters of ``max_lora_rank`` on every projection of every layer and on
embed_tokens and lm_head. The budget is
checked against one computed here from the model's config.json, and N such adapters loaded
through ``LLM`` must all stay in host memory (and one more must not fit)."""

from __future__ import annotations

import json

import pytest
import torch

from loraplex import LLM, SamplingParams
from loraplex.config import DEFAULT_MAX_CPU_LORA_BYTES, EngineConfig
from loraplex.lora.manager import LoRAManager
from tests.fixtures.peft_adapters import make_peft_adapter

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ALL_TARGETS = [*ALL_PROJECTIONS, "embed_tokens", "lm_head"]
RANK = 8
N = 3


def max_adapter_bytes(config: dict, rank: int, elem: int) -> int:
    """Bytes of A [r, in] and B [out, r] on every projection of every layer, and of the
    embedding's A [r, vocab], B [h, r] and lm_head's A [r, h], B [vocab, r], from an HF config."""
    h, i = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or h // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    in_out = [(h, q), (h, kv), (h, kv), (q, h), (h, i), (h, i), (i, h)]
    vocab = 2 * rank * (config["vocab_size"] + h)
    return (config["num_hidden_layers"] * rank * sum(a + b for a, b in in_out) + vocab) * elem


@pytest.fixture(scope="module")
def max_rank_adapters(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("max-cpu-loras")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()
    return [
        str(make_peft_adapter(base, root / f"a{k}", seed=k, r=RANK, target_modules=ALL_TARGETS))
        for k in range(N + 1)
    ]


def test_llm_max_cpu_loras_holds_n_max_rank_adapters(tiny_llama_dir, tmp_path, max_rank_adapters):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    per_adapter = max_adapter_bytes(config, RANK, elem=4)  # float32 host copies
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", device="cpu", home=tmp_path / "home",
              kv_cache_bytes=4 << 20, max_loras=2, max_lora_rank=RANK, max_cpu_loras=N)
    manager = llm.engine.lora_manager
    assert manager.host.budget_bytes == N * per_adapter

    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    first = max_rank_adapters[:N]
    llm.generate([[5, 6, 7]] * N, params, adapters=first)  # more adapters than device slots
    stats = manager.stats()["adapters"]
    assert sorted(manager.host.ids()) == sorted(stats)  # every one of the N is in host memory
    assert all(s["host_evictions"] == 0 and s["host_loads"] == 1 for s in stats.values())
    assert manager.host.used_bytes == N * per_adapter  # max rank on every projection: exactly full

    llm.generate([[5, 6, 7]], params, adapters=[max_rank_adapters[N]])  # one more does not fit
    evicted = [a for a, s in manager.stats()["adapters"].items() if s["host_evictions"]]
    assert len(evicted) == 1 and len(manager.host) == N


def test_llm_refuses_a_count_below_max_loras_or_beside_a_byte_budget(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match=r"^max_cpu_loras \(1\) must be >= max_loras \(2\)$"):
        LLM(model=str(tiny_llama_dir), home=tmp_path, max_loras=2, max_cpu_loras=1)
    with pytest.raises(ValueError, match="both size the host cache: give one"):
        LLM(model=str(tiny_llama_dir), home=tmp_path, max_cpu_loras=8, max_cpu_lora_bytes=1 << 30)


@pytest.mark.parametrize("dtype,elem", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_the_budget_follows_the_host_dtype_and_rank(lora_base, dtype, elem):
    config = lora_base.model.config.to_dict()

    def budget(**options) -> int:
        return LoRAManager(lora_base.spec, EngineConfig(max_loras=2, **options), "cpu", dtype).host.budget_bytes

    assert budget(max_lora_rank=16, max_cpu_loras=5) == 5 * max_adapter_bytes(config, 16, elem)
    assert budget(max_lora_rank=16, max_cpu_lora_bytes=12345) == 12345
    assert budget(max_lora_rank=16) == DEFAULT_MAX_CPU_LORA_BYTES  # neither given
