"""Layer level: the step context's shrink/expand against PEFT's own LoRA layers on random inputs,
for a mixed batch of adapters (different ranks, targets, patterns, layers) and base tokens."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.config import EngineConfig
from loraplex.lora.context import build_batch_meta
from loraplex.lora.manager import LoRAManager
from loraplex.lora.spec import PACKED_MODULES
from tests.fixtures.peft_adapters import peft_model_for

ADAPTERS = {
    "r1": dict(r=1, lora_alpha=3, target_modules=["q_proj", "down_proj"]),
    "r64": dict(r=64, lora_alpha=16, target_modules="all-linear"),
    "pat": dict(
        r=4,
        lora_alpha=6,
        use_rslora=True,
        target_modules=["k_proj", "v_proj", "gate_proj", "o_proj"],
        rank_pattern={"v_proj": 8},
        alpha_pattern={"layers.0.mlp.gate_proj": 2},
        layers_to_transform=[0],
    ),
}


def peft_delta(peft_model, adapter: str, layer: int, packed: str, x: torch.Tensor) -> torch.Tensor:
    """PEFT's own LoRA output for every slice of ``packed`` (zeros where not targeted)."""
    block = peft_model.base_model.model.model.layers[layer]
    parts = []
    for name in PACKED_MODULES[packed]:
        mod = getattr(block.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, name)
        base_out = mod.base_layer.out_features if hasattr(mod, "base_layer") else mod.out_features
        if hasattr(mod, "lora_A") and adapter in mod.lora_A:
            parts.append(mod.lora_B[adapter](mod.lora_A[adapter](x)) * mod.scaling[adapter])
        else:
            parts.append(torch.zeros(x.shape[0], base_out))
    return torch.cat(parts, dim=1)


@pytest.fixture
def mixed(lora_base, make_adapter):
    dirs = {name: make_adapter(name, seed=i + 10, **kw) for i, (name, kw) in enumerate(ADAPTERS.items())}
    manager = LoRAManager(lora_base.spec, EngineConfig(max_loras=4, max_lora_rank=64), "cpu", torch.float32)
    ids = {name: manager.register(name, d) for name, d in dirs.items()}
    return manager, ids, peft_model_for(lora_base.model, dirs)


def test_apply_matches_peft(mixed, lora_base):
    torch.manual_seed(0)
    manager, ids, peft_model = mixed
    rng = random.Random(0)
    names = [None, "r1", "r64", "pat"]
    token_names = [rng.choice(names) for _ in range(23)]
    ctx = manager.prepare_step([None if n is None else ids[n] for n in token_names])
    assert ctx is not None
    shapes = lora_base.spec.module_shapes
    with torch.no_grad():
        for layer in range(lora_base.spec.num_layers):
            for packed, slices in PACKED_MODULES.items():
                in_f = shapes[slices[0]][0]
                out_total = sum(shapes[s][1] for s in slices)
                x = torch.randn(len(token_names), in_f)
                y0 = torch.randn(len(token_names), out_total)
                y = y0.clone()
                ctx.apply(layer, packed, x, y)
                for t, name in enumerate(token_names):
                    expected = y0[t] if name is None else y0[t] + peft_delta(peft_model, name, layer, packed, x[t : t + 1])[0]
                    torch.testing.assert_close(y[t], expected, rtol=1e-5, atol=1e-5, msg=f"{layer} {packed} {t} {name}")


def test_base_only_step_has_no_context(mixed):
    manager, _, _ = mixed
    assert manager.prepare_step([None, None, None]) is None


def test_meta_groups_tokens_stably():
    torch.manual_seed(0)
    slots = [2, -1, 0, 2, 2, -1, 0, 1]
    ranks = [4, 8, 16, 0]
    meta = build_batch_meta(slots, torch.tensor(ranks, dtype=torch.int32), ranks)
    perm = meta.token_perm.tolist()
    assert sorted(perm) == list(range(len(slots)))
    # base tokens first, then slots in order; original order kept inside each group
    assert perm == [1, 5, 2, 6, 7, 0, 3, 4]
    assert meta.seg_slot_host == [0, 1, 2] and meta.seg_starts_host == [2, 4, 5, 8]
    assert meta.seg_starts.tolist() == meta.seg_starts_host and meta.seg_slot.tolist() == meta.seg_slot_host
    assert meta.max_seg_len == 3 and meta.max_rank == 16 and meta.num_tokens == 8
