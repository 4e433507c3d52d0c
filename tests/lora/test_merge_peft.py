"""loraplex.lora.merge against PEFT's own ``add_weighted_adapter`` (the independent reference):
the merged lora_A / lora_B tensors of every module, and the logits of the merged adapter's files
loaded back into PEFT, for linear, ties (both sign methods), and the DARE strategies at density 1
(PEFT's DARE draws from the global RNG; below 1 the drop is checked by its statistics and its
determinism). Three adapters of one rank with different targets, alphas and rsLoRA."""

from __future__ import annotations

import copy

import pytest
import torch
from peft import PeftModel

from loraplex.lora.merge import MergeError, MergeParams, drop_and_rescale, merge_adapters, write_adapter_dir
from loraplex.lora.peft_format import load_adapter_files, validate_adapter
from tests.fixtures.peft_adapters import make_peft_adapter, peft_model_for

ADAPTERS = {
    "a": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=4, lora_alpha=3, use_rslora=True, target_modules=["q_proj", "k_proj", "o_proj"]),
    "c": dict(r=4, lora_alpha=16, target_modules=["v_proj", "down_proj"]),
}
WEIGHTS = [1.5, -0.7, 0.4]
CASES = [
    ("linear", None, None),
    ("ties", 0.5, "total"),
    ("ties", 0.3, "frequency"),
    ("dare_linear", 1.0, None),
    ("dare_ties", 1.0, "total"),
    ("dare_ties", 1.0, "frequency"),
]


@pytest.fixture(scope="module")
def world(lora_base, tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    dirs = {n: make_peft_adapter(lora_base.model, root / n, seed=40 + i, **kw) for i, (n, kw) in enumerate(ADAPTERS.items())}
    parts = []
    for d in dirs.values():
        parsed = load_adapter_files(d)
        parts.append((parsed, validate_adapter(parsed, lora_base.spec, 64)))
    return dirs, parts, root


def _peft_merge(lora_base, dirs, strategy, density, sign):
    model = peft_model_for(lora_base.model, dirs)
    kwargs = {} if density is None else {"density": density}
    model.add_weighted_adapter(list(dirs), WEIGHTS, "merged", combination_type=strategy,
                               majority_sign_method=sign or "total", **kwargs)
    model.set_adapter("merged")
    return model


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("strategy, density, sign", CASES)
def test_merge_matches_peft_add_weighted_adapter(lora_base, world, strategy, density, sign):
    dirs, parts, root = world
    peft_model = _peft_merge(lora_base, dirs, strategy, density, sign)
    merged = merge_adapters(parts, MergeParams(strategy, tuple(WEIGHTS), density, sign), seed=7)

    # every merged module's tensors are PEFT's (PEFT names them ...lora_A.merged.weight)
    theirs = {n.replace(".merged", ""): p.detach() for n, p in peft_model.named_parameters() if ".merged." in n}
    targeted = {n for n in merged.tensors}
    assert targeted == {n for n in theirs if not torch.count_nonzero(theirs[n]) == 0}  # the union of targets
    for name, tensor in merged.tensors.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-5, atol=1e-6)

    # the files loaded back by PEFT give PEFT's merged model's logits
    path = write_adapter_dir(merged, root / f"out-{strategy}-{density}-{sign}")
    reloaded = PeftModel.from_pretrained(copy.deepcopy(lora_base.model), str(path)).eval()
    ids = [3, 17, 42, 8, 60, 11]
    want = _logits(peft_model, ids)
    torch.testing.assert_close(_logits(reloaded, ids), want, rtol=1e-4, atol=1e-5)
    with peft_model.disable_adapter():
        assert not torch.allclose(_logits(peft_model, ids), want, atol=1e-3)  # the merge changes the output


def test_dare_drop_is_deterministic_and_keeps_density(world):
    _, parts, _ = world
    params = MergeParams("dare_linear", tuple(WEIGHTS), 0.3)
    first = merge_adapters(parts, params, seed=11)
    again = merge_adapters(parts, params, seed=11)
    other = merge_adapters(parts, params, seed=12)
    assert all(torch.equal(first.tensors[n], again.tensors[n]) for n in first.tensors)
    assert any(not torch.equal(first.tensors[n], other.tensors[n]) for n in first.tensors)

    t = torch.randn(400, 300)
    kept = drop_and_rescale(t, 0.3, torch.Generator().manual_seed(0))
    mask = kept != 0
    assert abs(mask.float().mean().item() - 0.3) < 0.01  # Bernoulli(0.3) over 120k elements
    torch.testing.assert_close(kept[mask], t[mask] / 0.3)  # the kept ones rescaled by 1/density


def test_different_ranks_are_refused(lora_base, world, tmp_path):
    _, parts, _ = world
    d = make_peft_adapter(lora_base.model, tmp_path / "r8", seed=5, r=8, target_modules=["q_proj"])
    parsed = load_adapter_files(d)
    with pytest.raises(MergeError, match="different ranks"):
        merge_adapters([parts[0], (parsed, validate_adapter(parsed, lora_base.spec, 64))],
                       MergeParams("linear", (1.0, 1.0)), seed=0)


@pytest.mark.parametrize("strategy", ["ties", "dare_linear", "dare_ties"])
def test_a_single_adapter_is_merged_linear_as_peft_does(lora_base, world, strategy):
    """PEFT's add_weighted_adapter turns any strategy into ``linear`` for one adapter: the update is
    only scaled by the weight, nothing pruned or dropped (at density 0.3 pruning would show)."""
    dirs, parts, _ = world
    one = {"b": dirs["b"]}
    model = peft_model_for(lora_base.model, one)
    model.add_weighted_adapter(["b"], [0.8], "merged", combination_type=strategy, density=0.3)
    theirs = {n.replace(".merged", ""): p.detach() for n, p in model.named_parameters() if ".merged." in n}
    merged = merge_adapters([parts[1]], MergeParams(strategy, (0.8,), 0.3, "total"), seed=3)
    assert set(merged.tensors) == {n for n in theirs if torch.count_nonzero(theirs[n])}
    for name, tensor in merged.tensors.items():
        torch.testing.assert_close(tensor, theirs[name], rtol=1e-5, atol=1e-6)


def test_rslora_first_gives_the_merge_of_the_other_order(lora_base, world, tmp_path):
    """With the rsLoRA adapter first, PEFT 0.21's merged config inherits ``use_rslora`` and scales
    the merged update by a further sqrt(r) (fixed upstream, huggingface/peft#3449). A linear merge
    does not depend on the order, so the reference is PEFT's merge with the rsLoRA adapter second:
    loraplex's files, loaded into PEFT, give that model's logits in either order."""
    dirs, parts, _ = world
    weights = [0.6, 1.3]
    model = peft_model_for(lora_base.model, {"a": dirs["a"], "b": dirs["b"]})
    model.add_weighted_adapter(["a", "b"], weights, "merged", combination_type="linear")
    model.set_adapter("merged")
    ids = [3, 17, 42, 8, 60, 11]
    want = _logits(model, ids)
    merged = merge_adapters([parts[1], parts[0]], MergeParams("linear", tuple(weights[::-1])), seed=0)
    path = write_adapter_dir(merged, tmp_path / "rslora-first")
    reloaded = PeftModel.from_pretrained(copy.deepcopy(lora_base.model), str(path)).eval()
    torch.testing.assert_close(_logits(reloaded, ids), want, rtol=1e-4, atol=1e-5)


def test_expert_adapters_are_refused_as_peft_refuses_them(tmp_path):
    """LoRA on an MoE model's experts (PEFT's ``target_parameters``): PEFT's add_weighted_adapter
    refuses it, and so does the merge, instead of merging the attention modules alone."""
    from transformers import AutoModelForCausalLM

    from loraplex.model.config import ModelSpec
    from tests.fixtures.tiny_moe import make_tiny_moe_dir
    from tests.lora.test_moe_expert_lora import EXPERTS

    model_dir = make_tiny_moe_dir(tmp_path / "base", "qwen3_moe", "per_expert", seed=31)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    dirs = {"attn": make_peft_adapter(base, tmp_path / "attn", seed=1, r=4, target_modules=["q_proj"]),
            "experts": make_peft_adapter(base, tmp_path / "experts", seed=2, r=4, target_modules=["k_proj"],
                                         target_parameters=EXPERTS)}
    with pytest.raises(ValueError, match="nn.Parameter"):
        peft_model_for(base, dirs).add_weighted_adapter(list(dirs), [1.0, 1.0], "m", combination_type="linear")
    spec = ModelSpec.from_dir(model_dir).lora_target_spec(expert_lora=True)
    parts = []
    for d in dirs.values():
        parsed = load_adapter_files(d)
        parts.append((parsed, validate_adapter(parsed, spec, 8)))
    assert parts[1][1].expert_modules  # served by an expert-LoRA engine
    with pytest.raises(MergeError, match="experts"):
        merge_adapters(parts, MergeParams("linear", (1.0, 1.0)), seed=0)
