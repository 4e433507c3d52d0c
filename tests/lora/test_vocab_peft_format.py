"""Validation of LoRA on embed_tokens and lm_head against the files PEFT itself saves: accepted
with its targets, per-module ranks and scalings (rank/alpha patterns, rsLoRA) as PEFT computes
them, and the base-weight copies PEFT saves beside them left out; refused, naming the problem,
when the vocabulary was resized, the hidden size differs, a tensor is missing or misnamed, a base
weight belongs to a module the config does not target, or the base model has no vocabulary
shapes to check against."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from peft import PeftModel

from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.peft_format import inspect_adapter_dir, load_adapter_files
from loraplex.lora.records import host_nbytes
from loraplex.lora.weights import AdapterWeights
from tests.fixtures.peft_adapters import make_peft_adapter, spec_for, tiny_llama
from tests.lora.adapter_edits import edit_config, edit_tensors

EMBED_A = "base_model.model.model.embed_tokens.lora_embedding_A"
EMBED_B = "base_model.model.model.embed_tokens.lora_embedding_B"
HEAD_A = "base_model.model.lm_head.lora_A.weight"
HEAD_B = "base_model.model.lm_head.lora_B.weight"
EMBED_COPY = "base_model.model.model.embed_tokens.base_layer.weight"
HEAD_COPY = "base_model.model.lm_head.base_layer.weight"


@pytest.fixture(scope="module")
def base():
    return tiny_llama(seed=3)


@pytest.fixture(scope="module")
def vocab_adapter(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-format")
    return make_peft_adapter(base, root / "ehq", seed=5, r=8, lora_alpha=6, use_rslora=True,
                             target_modules=["embed_tokens", "lm_head", "q_proj"],
                             rank_pattern={"lm_head": 2}, alpha_pattern={"embed_tokens": 3})


def test_accepted_with_targets_ranks_and_scalings_as_peft_has_them(base, vocab_adapter):
    spec = spec_for(base)
    info = inspect_adapter_dir(vocab_adapter, spec, max_lora_rank=8)
    assert info.targets == ("q_proj", "embed_tokens", "lm_head")
    assert info.layers == (0, 1)
    peft_model = PeftModel.from_pretrained(copy.deepcopy(base), str(vocab_adapter))
    embed = peft_model.base_model.model.model.embed_tokens
    head = peft_model.base_model.model.lm_head
    assert info.vocab_modules["embed_tokens"].rank == embed.r["default"] == 8
    assert info.vocab_modules["embed_tokens"].scaling == pytest.approx(embed.scaling["default"])
    assert info.vocab_modules["lm_head"].rank == head.r["default"] == 2
    assert info.vocab_modules["lm_head"].scaling == pytest.approx(head.scaling["default"])
    assert info.summary()["targets"] == ["q_proj", "embed_tokens", "lm_head"]
    assert any("base-model weights" in w for w in info.warnings)  # PEFT saved them; not used

    parsed = load_adapter_files(vocab_adapter)
    assert {EMBED_COPY, HEAD_COPY} <= parsed.tensors.keys()  # what PEFT saves by default
    weights = AdapterWeights.build(parsed, info, spec, torch.float32)
    assert torch.equal(weights.vocab["embed_tokens"].a, embed.lora_embedding_A["default"].detach())
    assert torch.equal(weights.vocab["lm_head"].b, head.lora_B["default"].weight.detach())
    # host bytes: the LoRA tensors only, never the base copies
    lora_bytes = sum(t.numel() * 4 for n, t in parsed.tensors.items() if "base_layer" not in n)
    assert weights.nbytes == host_nbytes(info, spec, torch.float32) == lora_bytes


def test_head_only_adapter_is_accepted(base, tmp_path):
    adapter = make_peft_adapter(base, tmp_path / "head", seed=6, r=4, target_modules=["lm_head"])
    info = inspect_adapter_dir(adapter, spec_for(base), max_lora_rank=8)
    assert info.targets == ("lm_head",) and info.layers == () and info.rank == 4


def _grow_vocab(extra: int):
    """As if trained after resize_token_embeddings(vocab + extra): every vocab-sized dim grows."""

    def edit(t):
        t[EMBED_A] = torch.cat([t[EMBED_A], torch.randn(t[EMBED_A].shape[0], extra)], dim=1)
        t[HEAD_B] = torch.cat([t[HEAD_B], torch.randn(extra, t[HEAD_B].shape[1])], dim=0)
        for name in (EMBED_COPY, HEAD_COPY):
            t[name] = torch.cat([t[name], torch.randn(extra, t[name].shape[1])], dim=0)

    return edit


def _rename(old: str, new: str):
    def edit(t):
        t[new] = t.pop(old)

    return edit


def _set(name: str, fn):
    def edit(t):
        t[name] = fn(t[name])

    return edit


REFUSALS = {
    "resized_vocab": (_grow_vocab(8), r"vocabulary of 104 tokens, but base model 'tiny' has 96"),
    "resized_head_only": (_set(HEAD_B, lambda b: torch.cat([b, b[:3]])), r"vocabulary of 99 tokens.*has 96"),
    "embedding_hidden": (_set(EMBED_B, lambda b: torch.cat([b, b[:8]])),
                         r"lora_embedding_B' has shape \[72, 8\], base model needs \[64, 8\]"),
    "head_hidden": (_set(HEAD_A, lambda a: a[:, :32].contiguous()),
                    r"lm_head.lora_A.weight' has shape \[2, 32\], base model needs \[2, 64\]"),
    "missing_embedding_a": (lambda t: t.pop(EMBED_A),
                            r"missing tensor lora_A for targeted module 'model.embed_tokens'"),
    "missing_head_b": (lambda t: t.pop(HEAD_B), r"missing tensor lora_B for targeted module 'lm_head'"),
    "embedding_as_linear": (_rename(EMBED_A, "base_model.model.model.embed_tokens.lora_A.weight"),
                            r"saves LoRA on embed_tokens as lora_embedding_A"),
    "head_as_embedding": (_rename(HEAD_A, "base_model.model.lm_head.lora_embedding_A"),
                          r"saves LoRA on lm_head as lora_A.weight"),
    "resized_base_copy": (_set(EMBED_COPY, lambda w: torch.cat([w, w[:4]])), r"vocabulary of 100 tokens"),
}


@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_refused_naming_the_problem(base, vocab_adapter, tmp_path, kind):
    edit, message = REFUSALS[kind]
    bad = edit_tensors(vocab_adapter, tmp_path / kind, edit)
    with pytest.raises(InvalidAdapterError, match=message):
        inspect_adapter_dir(bad, spec_for(base), max_lora_rank=8)


def test_base_copy_of_an_untargeted_module_is_refused(base, vocab_adapter, tmp_path):
    """Full weights of lm_head without LoRA on it: a fully trained head (modules_to_save-like)."""
    src = edit_tensors(vocab_adapter, tmp_path / "no-head-lora", lambda t: [t.pop(HEAD_A), t.pop(HEAD_B)])
    bad = edit_config(src, tmp_path / "bad", target_modules=["embed_tokens", "q_proj"], rank_pattern={})
    with pytest.raises(InvalidAdapterError, match=r"holds full weights of 'lm_head'.*not served"):
        inspect_adapter_dir(bad, spec_for(base), max_lora_rank=8)


@pytest.mark.parametrize("field, value", [("modules_to_save", ["lm_head"]), ("trainable_token_indices", [1, 2])])
def test_full_module_and_trainable_token_features_stay_refused(base, vocab_adapter, tmp_path, field, value):
    bad = edit_config(vocab_adapter, tmp_path / field, **{field: value})
    with pytest.raises(InvalidAdapterError, match=re.escape(field)):
        inspect_adapter_dir(bad, spec_for(base), max_lora_rank=8)


def test_refused_when_the_base_model_has_no_vocabulary_shapes(base, vocab_adapter):
    """A spec without vocab_size/hidden_size (nothing to check shapes against) serves none."""
    from dataclasses import replace

    spec = replace(spec_for(base), vocab_size=0, hidden_size=0)
    with pytest.raises(InvalidAdapterError, match=r"does not serve LoRA on"):
        inspect_adapter_dir(vocab_adapter, spec, max_lora_rank=8)


def test_adapter_saved_without_base_copies_is_accepted_without_warning(base, vocab_adapter, tmp_path):
    """``save_pretrained(save_embedding_layers=False)``: only the LoRA tensors."""
    slim = edit_tensors(vocab_adapter, tmp_path / "slim", lambda t: [t.pop(EMBED_COPY), t.pop(HEAD_COPY)])
    info = inspect_adapter_dir(slim, spec_for(base), max_lora_rank=8)
    assert info.targets == ("q_proj", "embed_tokens", "lm_head") and info.warnings == ()
