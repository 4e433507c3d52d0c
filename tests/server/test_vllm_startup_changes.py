"""``serve --lora-modules`` when a module's directory changes between the start-up's check and
its upload: what is registered is what was checked, and the start never half-registers."""

from __future__ import annotations

import shutil

import pytest

from loraplex.cli import build_parser
from loraplex.config import Settings
from loraplex.lora.peft_format import WEIGHTS_NAME, compute_content_hash
from loraplex.registry.service import RegistryService
from loraplex.server import vllm_startup
from loraplex.server.vllm_flags import startup_flags
from tests.fixtures.peft_adapters import make_peft_adapter, tiny_llama

# tiny_llama_dir's shapes (tests/fixtures/tiny_models.py BASE_SHAPE) for peft's tiny Llama
MATCHING = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def originals(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup-change-adapters")
    base = tiny_llama(seed=5, **MATCHING)
    return {"a": make_peft_adapter(base, root / "a", seed=1), "b": make_peft_adapter(base, root / "b", seed=2)}


def test_a_module_removed_after_the_check_registers_what_was_checked(
        registry_url, tmp_path, tiny_llama_dir, originals, monkeypatch):
    settings = Settings(home=tmp_path / "home", database_url=registry_url, model=str(tiny_llama_dir), admin_key="x")
    registry = RegistryService.from_url(registry_url)
    dirs = {name: tmp_path / name for name in originals}
    for name, source in originals.items():
        shutil.copytree(source, dirs[name])
    real_check = vllm_startup.check_module

    def check_then_remove(module, manager, **shown):
        real_check(module, manager, **shown)
        if module.name == "chat":  # the last check passed; an operator now deletes the file
            (dirs["b"] / WEIGHTS_NAME).unlink()

    monkeypatch.setattr(vllm_startup, "check_module", check_then_remove)
    args = build_parser().parse_args(["serve", "m", "--lora-modules", f"sql={dirs['a']}", f"chat={dirs['b']}"])
    outcome = vllm_startup.apply_startup_flags(startup_flags(args), settings, registry)
    served = {m.name: m.sha256 for m in outcome.modules}
    assert served == {"sql": compute_content_hash(originals["a"]), "chat": compute_content_hash(originals["b"])}
    for name, sha in served.items():
        assert registry.get_adapter("default", name).versions[0].sha256 == sha
