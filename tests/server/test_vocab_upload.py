"""Uploading adapters with LoRA on embed_tokens and lm_head through the admin API (real
AdapterManager, local blob store, fake engine): a PEFT-saved adapter is stored and listed with
its targets; one trained on a resized vocabulary, with another hidden size, or missing a tensor
is answered 400 in the OpenAI envelope naming the problem, and nothing is stored."""

from __future__ import annotations

import re

import pytest
import torch
from starlette.testclient import TestClient

from tests.fixtures.peft_adapters import make_peft_adapter, tiny_llama
from tests.lora.adapter_edits import edit_tensors
from tests.server.test_errors_fake import _envelope
from tests.server.test_upload_refusals import ADMIN_KEY, World, _fields, _post, _targz

EMBED_A = "base_model.model.model.embed_tokens.lora_embedding_A"
EMBED_B = "base_model.model.model.embed_tokens.lora_embedding_B"
HEAD_B = "base_model.model.lm_head.lora_B.weight"


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("vocab-upload")
    w = World(root)
    # the base World's spec is for (build_adapters: tiny_llama(seed=11), vocab 96, hidden 64)
    w.vocab_dir = make_peft_adapter(tiny_llama(seed=11), root / "vocab", seed=7, r=4,
                                    target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj"])
    with TestClient(w.app) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        w.client = client
        yield w


def test_vocab_adapter_is_stored_and_listed_with_its_targets(world):
    r = _post(world, _fields(world.vocab_dir), name="cpt")
    assert r.status_code == 201, r.text
    assert r.json()["targets"] == ["q_proj", "v_proj", "embed_tokens", "lm_head"]
    listed = world.client.get("/admin/v1/tenants/acme/adapters/cpt").json()
    versions = listed.get("versions") or []
    assert any(v.get("targets") == ["q_proj", "v_proj", "embed_tokens", "lm_head"] for v in versions), listed
    assert world.client.delete("/admin/v1/tenants/acme/adapters/cpt").status_code == 200


def _grow(name: str, extra: int, dim: int):
    def edit(t):
        pad_shape = list(t[name].shape)
        pad_shape[dim] = extra
        t[name] = torch.cat([t[name], torch.randn(pad_shape)], dim=dim)

    return edit


REFUSALS = {
    "resized_embedding": (_grow(EMBED_A, 8, 1), r"vocabulary of 104 tokens, but base model .* has 96"),
    "resized_head": (_grow(HEAD_B, 8, 0), r"vocabulary of 104 tokens, but base model .* has 96"),
    "wrong_hidden": (_grow(EMBED_B, 8, 0), r"lora_embedding_B' has shape \[72, 4\], base model needs \[64, 4\]"),
    "missing_a": (lambda t: t.pop(EMBED_A), r"missing tensor lora_A for targeted module 'model.embed_tokens'"),
    "missing_b": (lambda t: t.pop(HEAD_B), r"missing tensor lora_B for targeted module 'lm_head'"),
}


@pytest.mark.parametrize("kind", sorted(REFUSALS))
def test_bad_vocab_adapter_is_refused_and_changes_nothing(world, kind, tmp_path):
    edit, message = REFUSALS[kind]
    bad = edit_tensors(world.vocab_dir, tmp_path / kind, edit)
    before = world.state()
    for files in (_fields(bad), _targz(bad)):
        err = _envelope(_post(world, files, name=kind), 400, code="invalid_adapter", param="adapter")
        assert re.search(message, err["message"]), err["message"]
    assert world.state() == before
