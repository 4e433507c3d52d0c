"""``loraplex serve --api-key ... --lora-modules ...``: what start-up leaves in the registry and the
blob store, checked against an upload of the same directory (``loraplex adapters upload``'s
path), on SQLite and PostgreSQL."""

from __future__ import annotations

import shutil
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from loraplex.cli import build_parser, main
from loraplex.config import Settings
from loraplex.lora.peft_format import compute_content_hash
from loraplex.registry.adapter_manager import build_adapter_manager
from loraplex.registry.base_model import base_model_spec
from loraplex.registry.service import RegistryService
from loraplex.server.vllm_flags import startup_flags
from loraplex.server.vllm_startup import StartupError, apply_startup_flags
from loraplex.storage.base import content_key
from tests.fixtures.peft_adapters import make_peft_adapter, tiny_llama

# tiny_llama_dir's shapes (tests/fixtures/tiny_models.py BASE_SHAPE) for peft's tiny Llama
MATCHING = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("startup-adapters")
    base = tiny_llama(seed=5, **MATCHING)
    return {
        "a": make_peft_adapter(base, root / "a", seed=1),
        "b": make_peft_adapter(base, root / "b", seed=2, r=8, target_modules=["q_proj", "down_proj"]),
        "wrong": make_peft_adapter(tiny_llama(seed=0, hidden_size=32, intermediate_size=48), root / "wrong", seed=3),
    }


@pytest.fixture
def world(registry_url, tmp_path, tiny_llama_dir):
    settings = Settings(home=tmp_path / "home", database_url=registry_url, model=str(tiny_llama_dir), admin_key="x")
    registry = RegistryService.from_url(registry_url)
    return settings, registry


def flags(*argv: str):
    return startup_flags(build_parser().parse_args(["serve", "m", *argv]))


def modules(**dirs) -> list[str]:
    return ["--lora-modules", *(f"{name}={path}" for name, path in dirs.items())]


def test_modules_and_keys_land_in_the_tenant_as_an_upload_would(world, adapter_dirs):
    settings, registry = world
    outcome = apply_startup_flags(
        flags(*modules(sql=adapter_dirs["a"]), "--lora-modules",
              f'{{"name": "chat", "path": "{adapter_dirs["b"]}", "base_model_name": "m"}}', "--api-key", "sk-team"),
        settings, registry)
    assert outcome.tenant_created and [t.name for t in registry.list_tenants()] == ["default"]
    assert registry.authenticate("sk-team") == "default"
    adapters = {a.name: a for a in registry.list_adapters("default")}
    assert set(adapters) == {"sql", "chat"}
    for name, key in (("sql", "a"), ("chat", "b")):
        assert adapters[name].active_version == 1 and len(adapters[name].versions) == 1
        version = adapters[name].versions[0]
        assert version.sha256 == compute_content_hash(adapter_dirs[key]) and version.uploader == "serve --lora-modules"
    # the same directory uploaded by an operator: the same content hash, blob and base model
    registry.create_tenant("operator")
    manager = build_adapter_manager(settings, registry, base_model_spec(settings))
    assert manager.snapshot_root == settings.home / "staging"  # copies where the server's start sweeps
    uploaded, _ = manager.upload("operator", "sql", adapter_dirs["a"], uploader="cli")
    sql = adapters["sql"].versions[0]
    assert (uploaded.sha256, uploaded.blob_key, uploaded.base_model, uploaded.rank) == (
        sql.sha256, sql.blob_key, sql.base_model, sql.rank)
    assert manager.blobs.exists(content_key(sql.sha256))
    assert "sql: default/sql@1 (new version, now active)" in "\n".join(outcome.notes())
    assert "sk-team" not in "\n".join(outcome.notes())


def test_a_restart_with_the_same_flags_changes_nothing(world, adapter_dirs):
    settings, registry = world
    argv = (*modules(sql=adapter_dirs["a"]), "--api-key", "sk-team")
    apply_startup_flags(flags(*argv), settings, registry)
    events = len(registry.list_audit(limit=1000))
    again = apply_startup_flags(flags(*argv), settings, registry)
    assert [(m.version, m.created, m.activated) for m in again.modules] == [(1, False, False)]
    assert not again.tenant_created and (again.keys_added, again.keys_kept) == (0, 1)
    assert len(registry.list_audit(limit=1000)) == events  # not even an audit line
    assert len(registry.get_adapter("default", "sql").versions) == 1


def test_a_changed_directory_becomes_the_new_active_version(world, adapter_dirs, tmp_path):
    settings, registry = world
    path = tmp_path / "sql"
    shutil.copytree(adapter_dirs["a"], path)
    apply_startup_flags(flags(*modules(sql=path)), settings, registry)
    shutil.rmtree(path)
    shutil.copytree(adapter_dirs["b"], path)  # the operator replaced the adapter in place
    swapped = apply_startup_flags(flags(*modules(sql=path)), settings, registry)
    adapter = registry.get_adapter("default", "sql")
    assert [(m.version, m.created, m.activated) for m in swapped.modules] == [(2, True, True)]
    assert adapter.active_version == 2
    assert registry.resolve("default", "sql").sha256 == compute_content_hash(adapter_dirs["b"])
    back = apply_startup_flags(flags(*modules(sql=adapter_dirs["a"])), settings, registry)  # rolled back
    assert [(m.version, m.created, m.activated) for m in back.modules] == [(1, False, True)]
    assert [v.version for v in registry.get_adapter("default", "sql").versions] == [1, 2]


@pytest.mark.parametrize("bad,why", [("wrong", "shape"), ("missing", "is not a directory"),
                                     ("empty", "adapter_config.json is missing")])
def test_an_invalid_module_stops_start_with_nothing_registered(world, adapter_dirs, tmp_path, bad, why):
    settings, registry = world
    paths = {"wrong": adapter_dirs["wrong"], "missing": tmp_path / "nope", "empty": tmp_path}
    argv = (*modules(sql=adapter_dirs["a"], broken=paths[bad]), "--api-key", "sk-team")
    with pytest.raises(StartupError) as caught:
        apply_startup_flags(flags(*argv), settings, registry)
    message = str(caught.value)
    assert message.startswith(f"--lora-modules broken={paths[bad]}: ") and why in message
    assert registry.list_tenants() == [] and registry.authenticate("sk-team") is None
    blobs = settings.home / "blobs"
    assert not blobs.exists() or not any(p.is_file() for p in blobs.rglob("*"))


def test_a_module_named_as_the_served_base_model_stops_start(world, adapter_dirs, tiny_llama_dir):
    """Without --served-model-name the base model is served under its directory's name (the
    engine's, not the --model path): a module of that name could be reached only as name@N."""
    settings, registry = world
    assert settings.served_name == tiny_llama_dir.name != settings.model
    with pytest.raises(StartupError) as caught:
        apply_startup_flags(flags(*modules(**{tiny_llama_dir.name: adapter_dirs["a"]})), settings, registry)
    assert f"adapter name '{tiny_llama_dir.name}' is the served base model's name" in str(caught.value)
    assert registry.list_tenants() == []


def test_replicas_starting_at_once_end_with_one_version_per_content(world, adapter_dirs):
    settings, registry = world
    argv = (*modules(sql=adapter_dirs["a"], chat=adapter_dirs["b"]), "--api-key", "sk-team")
    barrier = threading.Barrier(3)

    def replica(_):
        barrier.wait()
        return apply_startup_flags(flags(*argv), settings, RegistryService.from_url(settings.database_url))

    with ThreadPoolExecutor(3) as pool:
        outcomes = list(pool.map(replica, range(3)))
    for name in ("sql", "chat"):
        adapter = registry.get_adapter("default", name)
        assert [v.version for v in adapter.versions] == [1] and adapter.active_version == 1
    assert sum(m.created for o in outcomes for m in o.modules) == 2
    assert [k.revoked for k in registry.list_api_keys("default")] == [False]


def test_serve_exits_2_naming_the_invalid_module(monkeypatch, tmp_path, capsys, tiny_llama_dir, adapter_dirs):
    for name in ("LORAPLEX_DATABASE_URL", "LORAPLEX_BLOB_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("LORAPLEX_ADMIN_KEY", raising=False)  # the first start generates one
    argv = ["serve", str(tiny_llama_dir), "--enable-lora", "--api-key", "sk-team",
            "--lora-modules", f"good={adapter_dirs['a']}", f"bad={adapter_dirs['wrong']}"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert f"loraplex serve: error: --lora-modules bad={adapter_dirs['wrong']}: " in err
    assert "sk-team" not in err + out
    registry = RegistryService.from_url(f"sqlite:///{tmp_path / 'home' / 'loraplex.db'}")
    assert registry.get_tenant("default") is None
    # the admin key generated by this failed start was still shown, once: it is the stored one
    admin = out.split("admin key (shown once, stored hashed): ")[1].split()[0]
    assert registry.check_admin_key(admin)
    assert "this start failed, but the keys printed above are stored and stay valid" in err  # said so


def test_an_invalid_tenant_name_stops_start(world, adapter_dirs):
    settings, registry = world
    settings = settings.model_copy(update={"vllm_tenant": "../etc"})
    with pytest.raises(StartupError, match=r"vLLM flags \(tenant '../etc'\): .*tenant name"):
        apply_startup_flags(flags(*modules(sql=adapter_dirs["a"]), "--api-key", "sk-team"), settings, registry)
    assert registry.list_tenants() == []


def test_without_the_flags_the_vllm_tenant_is_not_looked_at(world):
    """A server started without --api-key and --lora-modules writes nothing for them and does not
    check the (unused) tenant name."""
    settings, registry = world
    settings = settings.model_copy(update={"vllm_tenant": "../etc"})
    outcome = apply_startup_flags(flags(), settings, registry)
    assert outcome.notes() == [] and registry.list_tenants() == []


def test_a_start_for_a_deleted_vllm_tenant_is_refused_and_recreates_nothing(world, adapter_dirs):
    """``serve --api-key K`` again after the operator deleted the ``--vllm-tenant``: refused with
    a message saying so (tenant names are never reused), the tenant stays deleted, K stays revoked."""
    settings, registry = world
    apply_startup_flags(flags("--api-key", "sk-team"), settings, registry)
    registry.delete_tenant("default")
    with pytest.raises(StartupError, match=r"tenant 'default'\): tenant 'default' was deleted.*never reused"):
        apply_startup_flags(flags(*modules(sql=adapter_dirs["a"]), "--api-key", "sk-team"), settings, registry)
    assert registry.list_tenants() == [] and registry.authenticate("sk-team") is None
    assert registry.versions_using_blob(content_key(compute_content_hash(adapter_dirs["a"]))) == 0
