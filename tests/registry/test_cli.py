"""``loraplex tenants`` / ``loraplex adapters`` through ``loraplex.cli.main`` on a temp home."""

from __future__ import annotations

import io
import json

import pytest

from loraplex.cli import main
from loraplex.config import Settings
from loraplex.lora.peft_format import compute_content_hash
from loraplex.registry.adapter_manager import build_adapter_manager
from loraplex.registry.cli import base_model_spec
from loraplex.registry.service import RegistryService
from loraplex.storage.base import content_key, open_blob_store
from tests.fixtures.peft_adapters import make_peft_adapter, spec_for, tiny_llama


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    base = tiny_llama(seed=5)
    model_dir = root / "tiny-base"
    base.config.save_pretrained(model_dir)  # config.json only: validation needs no weights
    other = tiny_llama(seed=0, hidden_size=32, intermediate_size=48)
    other.config.save_pretrained(root / "other-base")
    adapters = {
        "a": make_peft_adapter(base, root / "a", seed=1, r=4),
        "b": make_peft_adapter(base, root / "b", seed=2, r=8),
        "big": make_peft_adapter(base, root / "big", seed=3, r=128),
    }
    return {"model_dir": model_dir, "other_config": root / "other-base" / "config.json", "adapters": adapters, "base": base}


@pytest.fixture
def home(tmp_path, monkeypatch, setup):
    home = tmp_path / "home"
    monkeypatch.setenv("LORAPLEX_HOME", str(home))
    monkeypatch.setenv("LORAPLEX_MODEL", str(setup["model_dir"]))
    for name in ("LORAPLEX_DATABASE_URL", "LORAPLEX_BLOB_URL", "LORAPLEX_MAX_LORA_RANK"):
        monkeypatch.delenv(name, raising=False)
    return home


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_embedded_default_walkthrough(home, setup, capsys):
    a, b = setup["adapters"]["a"], setup["adapters"]["b"]
    assert run(capsys, "tenants", "create", "acme")[0] == 0
    code, out, _ = run(capsys, "tenants", "list")
    assert code == 0 and out.split()[0] == "acme"

    code, out, _ = run(capsys, "adapters", "upload", "--tenant", "acme", "--name", "support", str(a))
    assert code == 0 and "uploaded acme/support@1" in out and compute_content_hash(a) in out
    code, out, _ = run(capsys, "adapters", "upload", "--tenant", "acme", "--name", "support", str(b), "--activate")
    assert code == 0 and "support@2" in out
    code, out, _ = run(capsys, "adapters", "upload", "--tenant", "acme", "--name", "support", str(a))
    assert code == 0 and "identical to existing acme/support@1" in out

    code, out, _ = run(capsys, "adapters", "list", "--tenant", "acme", "--json")
    listed = json.loads(out)
    assert code == 0 and [x["name"] for x in listed] == ["support"]
    assert listed[0]["active_version"] == 2  # --activate
    assert [v["sha256"] for v in listed[0]["versions"]] == [compute_content_hash(a), compute_content_hash(b)]
    code, out, _ = run(capsys, "adapters", "list", "--tenant", "acme")
    assert "  v1" in out and "* v2" in out

    assert run(capsys, "adapters", "activate", "--tenant", "acme", "--name", "support", "--version", "1")[0] == 0
    registry = RegistryService.from_url(Settings().resolved_database_url())
    assert registry.resolve("acme", "support").version == 1
    assert run(capsys, "adapters", "activate", "--tenant", "acme", "--name", "support", "--version", "2")[0] == 0
    assert registry.resolve("acme", "support").version == 2
    assert (home / "loraplex.db").exists()  # embedded default: SQLite under LORAPLEX_HOME

    blobs = open_blob_store(str(home / "blobs"))
    key_a = content_key(compute_content_hash(a))
    assert blobs.exists(key_a)
    assert run(capsys, "adapters", "delete", "--tenant", "acme", "--name", "support", "--version", "1")[0] == 0
    assert not blobs.exists(key_a)
    assert run(capsys, "adapters", "delete", "--tenant", "acme", "--name", "support")[0] == 0
    assert json.loads(run(capsys, "adapters", "list", "--tenant", "acme", "--json")[1]) == []
    leftover = content_key("e" * 64)  # a blob no version uses, as a crash would leave
    blobs.put(leftover, io.BytesIO(b"x"), 1)
    code, out, _ = run(capsys, "adapters", "gc", "--min-age-seconds", "0")
    assert code == 0 and leftover in out and not blobs.exists(leftover)
    actions = {e.action for e in registry.list_audit("acme")}
    assert {"adapter.upload", "adapter.activate", "adapter.version.delete", "adapter.delete"} <= actions


@pytest.mark.parametrize(
    "argv,message",
    [
        (["tenants", "create", "../evil"], "tenant"),
        (["adapters", "upload", "--tenant", "nobody", "--name", "x", "{a}"], "not found"),
        (["adapters", "upload", "--tenant", "acme", "--name", "a/b", "{a}"], "name"),
        (["adapters", "upload", "--tenant", "acme", "--name", "x", "{big}"], "max_lora_rank"),
        (["adapters", "upload", "--tenant", "acme", "--name", "x", "{a}", "--base-config", "{other}"], "shape"),
        (["adapters", "upload", "--tenant", "acme", "--name", "x", "/nonexistent/dir"], "not a directory"),
        # the served base model's name (its folder's), refused as the admin API refuses it
        (["adapters", "upload", "--tenant", "acme", "--name", "tiny-base", "{a}"], "served base model's name"),
        (["adapters", "upload", "--tenant", "acme", "--name", "x", "{a}", "--base-config", "/missing.json"],
         "--base-config /missing.json: "),
        (["adapters", "activate", "--tenant", "acme", "--name", "nope", "--version", "1"], "not found"),
        (["adapters", "delete", "--tenant", "acme", "--name", "s", "--version", "1"], "active version"),
    ],
)
def test_errors_are_one_clear_line(home, setup, capsys, argv, message):
    assert run(capsys, "tenants", "create", "acme")[0] == 0
    assert run(capsys, "adapters", "upload", "--tenant", "acme", "--name", "s", str(setup["adapters"]["a"]))[0] == 0
    subst = {"{a}": str(setup["adapters"]["a"]), "{big}": str(setup["adapters"]["big"]), "{other}": str(setup["other_config"])}
    code, out, err = run(capsys, *[subst.get(x, x) for x in argv])
    assert code == 1 and err.startswith("error: ") and message in err and err.count("\n") == 1
    assert len(list((home / "blobs" / "sha256").iterdir())) == 1  # nothing new stored


def test_base_spec_from_model_dir_and_base_config(home, setup):
    reference = spec_for(setup["base"])  # built from the transformers model itself
    spec = base_model_spec(Settings())
    assert spec.model_name == "tiny-base"  # as the engine names a model directory
    assert (spec.num_layers, spec.module_shapes) == (reference.num_layers, reference.module_shapes)
    other = base_model_spec(Settings(), str(setup["other_config"]))
    assert other.module_shapes["q_proj"] == (32, 32)


@pytest.mark.postgres
def test_cli_on_postgres_and_s3(home, setup, capsys, monkeypatch, pg_url, s3_blob_url):
    monkeypatch.setenv("LORAPLEX_DATABASE_URL", pg_url)
    monkeypatch.setenv("LORAPLEX_BLOB_URL", s3_blob_url)
    a = setup["adapters"]["a"]
    assert run(capsys, "tenants", "create", "acme")[0] == 0
    code, out, err = run(capsys, "adapters", "upload", "--tenant", "acme", "--name", "support", str(a))
    assert code == 0, err
    assert not (home / "blobs").exists() and not (home / "loraplex.db").exists()
    settings = Settings()
    registry = RegistryService.from_url(pg_url)
    manager = build_adapter_manager(settings, registry, spec_for(setup["base"]))
    ref = manager.resolve("acme", "support")
    assert compute_content_hash(ref.path) == compute_content_hash(a)
    assert run(capsys, "adapters", "delete", "--tenant", "acme", "--name", "support")[0] == 0
    assert not manager.blobs.exists(content_key(compute_content_hash(a)))


def test_a_home_nothing_can_be_written_in_is_one_line(tmp_path, monkeypatch, capsys, setup):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "a-file" / "home"))
    monkeypatch.setenv("LORAPLEX_MODEL", str(setup["model_dir"]))
    code, _, err = run(capsys, "tenants", "list")
    assert code == 1 and err.startswith("error: LORAPLEX_HOME ") and "not a folder" in err and err.count("\n") == 1


def test_gc_refuses_a_negative_age(home, setup, capsys):
    with pytest.raises(SystemExit) as caught:  # argparse: exit 2 and its one usage error
        main(["adapters", "gc", "--min-age-seconds", "-5"])
    assert caught.value.code == 2 and "must be a number of seconds >= 0" in capsys.readouterr().err
