"""Uploads through the admin API to the real AdapterManager (local blob store, disk cache) over a
fake engine: every refusal answers in the OpenAI envelope and changes nothing (no registry row,
no blob, no disk-cache entry, no staging file); dedup and cross-tenant deletes keep exactly the
blobs live versions use."""

from __future__ import annotations

import io
import re
import tarfile

import pytest
from starlette.testclient import TestClient

from loraplex.config import Settings
from loraplex.registry import db
from loraplex.registry.adapter_manager import AdapterManager
from loraplex.registry.service import RegistryService
from loraplex.server.app import create_app
from loraplex.storage.base import open_blob_store
from tests.lora.adapter_edits import BAD_ADAPTERS
from tests.registry.adapter_manager_helpers import build_adapters
from tests.server.fakes import FakeEngine
from tests.server.test_errors_fake import _envelope

ADMIN_KEY = "refusals-admin-key"
FILES = ("adapter_config.json", "adapter_model.safetensors")
MAX_RANK = 8  # BAD_ADAPTERS["rank_above_max"] is rank 16


class World:
    def __init__(self, root):
        self.spec, self.dirs = build_adapters(root / "adapters")
        self.home = root / "home"
        self.home.mkdir()
        url = f"sqlite:///{self.home / 'registry.db'}"
        db.upgrade(url)
        self.registry = RegistryService.from_url(url)
        self.blobs_dir = self.home / "blobs"
        self.manager = AdapterManager(
            self.registry, open_blob_store(str(self.blobs_dir)),
            AdapterManager.make_disk_cache(self.home / "adapter-cache", 1 << 30), self.spec, MAX_RANK,
        )
        self.engine = FakeEngine()
        settings = Settings(home=self.home, admin_key=ADMIN_KEY, database_url=url, blob_gc_interval_seconds=0,
                            max_upload_member_bytes=1 << 20)
        self.app = create_app(settings, engine=self.engine, registry=self.registry, adapters=self.manager)
        for tenant in ("acme", "other"):
            self.registry.create_tenant(tenant)

    def state(self) -> dict:
        """Everything an upload may change, read from the stores themselves."""
        return {
            "adapters": {t: [(a.name, [v.version for v in a.versions]) for a in self.registry.list_adapters(t)]
                         for t in ("acme", "other")},
            "blobs": sorted(p.name for p in self.blobs_dir.rglob("*") if p.is_file()),
            "cache": sorted(p.name for p in (self.home / "adapter-cache" / "entries").iterdir()),
            "staging": sorted(p.name for p in (self.home / "staging").rglob("*")) if (self.home / "staging").exists() else [],
            "engine": dict(self.engine.loaded),
        }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    w = World(tmp_path_factory.mktemp("refusals"))
    with TestClient(w.app) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        w.client = client
        yield w


def _fields(d) -> dict:
    return {n: (n, (d / n).read_bytes(), "application/octet-stream") for n in FILES}


def _targz(d, top: str = "adapter") -> dict:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for p in sorted(d.iterdir()):
            tar.add(p, arcname=f"{top}/{p.name}")
    return {"archive": ("adapter.tar.gz", buf.getvalue(), "application/gzip")}


def _post(world, files, tenant="acme", name="x"):
    return world.client.post(f"/admin/v1/tenants/{tenant}/adapters/{name}/versions", files=files)


@pytest.mark.parametrize("kind", sorted(BAD_ADAPTERS))
def test_bad_adapter_archive_changes_nothing(world, kind, tmp_path):
    make, message = BAD_ADAPTERS[kind]
    bad = make(world.dirs["a"], tmp_path / kind)
    before = world.state()
    err = _envelope(_post(world, _targz(bad)), 400, code="invalid_adapter", param="adapter")
    assert re.search(message, err["message"]), err["message"]
    if kind != "pickle":  # the two-field form carries no extra files
        err = _envelope(_post(world, _fields(bad)), 400, code="invalid_adapter", param="adapter")
        assert re.search(message, err["message"]), err["message"]
    assert world.state() == before


@pytest.mark.parametrize(
    "files, status, param",
    [
        ({"adapter_config.json": ("adapter_config.json", b"{}")}, 400, "adapter_model.safetensors"),
        ({"adapter_model.safetensors": ("w", b"\0" * 8)}, 400, "adapter_config.json"),
        ({"archive": ("a.zip", b"PK\x03\x04 not a zip")}, 400, "archive"),
        ({"archive": ("a.tar.gz", b"")}, 400, "archive"),
        ({"adapter_config.json": ("c", b'{"r": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"),
          "adapter_model.safetensors": ("w", b"\0" * 8)}, 400, "adapter"),
        ({"adapter_config.json": ("c", b"{}"), "adapter_model.safetensors": ("w", b"\0" * ((1 << 20) + 1))}, 413, "adapter_model.safetensors"),
    ],
    ids=["no_weights", "no_config", "bad_zip", "empty_archive", "deep_json", "member_over_cap"],
)
def test_bad_form_changes_nothing(world, files, status, param):
    before = world.state()
    _envelope(_post(world, files), status, param=param)
    assert world.state() == before


def test_archive_tricks_change_nothing(world, tmp_path):
    good = world.dirs["a"]
    before = world.state()
    bomb = io.BytesIO()
    with tarfile.open(fileobj=bomb, mode="w:gz") as tar:
        for p in sorted(good.iterdir()):
            tar.add(p, arcname=p.name)
        for i in range(3):  # each under the 1 MiB member cap, together over twice it
            info = tarfile.TarInfo(f"junk{i}")
            info.size = (1 << 20) - 1
            tar.addfile(info, io.BytesIO(b"\0" * info.size))
    _envelope(_post(world, {"archive": ("bomb.tar.gz", bomb.getvalue())}), 413, param="archive")
    evil = io.BytesIO()
    with tarfile.open(fileobj=evil, mode="w:gz") as tar:
        tar.add(good / "adapter_config.json", arcname="../../adapter_config.json")
    _envelope(_post(world, {"archive": ("evil.tar.gz", evil.getvalue())}), 400, param="archive")
    assert world.state() == before
    assert not (world.home.parent / "adapter_config.json").exists()


def test_dedup_and_cross_tenant_delete_keep_exactly_the_used_blobs(world):
    a, b = world.dirs["a"], world.dirs["b"]
    first = _post(world, _fields(a), name="dup")
    assert first.status_code == 201 and first.json()["created"] is True
    again = _post(world, _targz(a, top="nested"), name="dup")  # same bytes, as an archive
    assert again.status_code == 200 and again.json()["created"] is False and again.json()["version"] == 1
    sha = first.json()["sha256"]
    theirs = _post(world, _fields(a), tenant="other", name="dup")
    assert theirs.status_code == 201 and theirs.json()["sha256"] == sha
    v2 = _post(world, _fields(b), name="dup")
    assert v2.status_code == 201 and v2.json()["version"] == 2
    assert world.state()["blobs"] == sorted([sha, v2.json()["sha256"]])

    c = world.client
    assert c.delete("/admin/v1/tenants/acme/adapters/dup").status_code == 200
    assert world.state()["blobs"] == [sha]  # b's blob had no other user; a's is other's too
    assert c.delete("/admin/v1/tenants/other/adapters/dup").status_code == 200
    assert world.state()["blobs"] == [] and world.state()["cache"] == []
