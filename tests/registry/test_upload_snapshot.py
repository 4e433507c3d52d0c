"""An upload stores the bytes it checked and hashed, even when the directory changes meanwhile
(an operator re-saving an adapter, a runtime load of a directory another process writes)."""

from __future__ import annotations

import shutil

import pytest

from loraplex.lora.errors import InvalidAdapterError
from loraplex.lora.peft_format import WEIGHTS_NAME, compute_content_hash
from loraplex.lora.snapshot import SNAPSHOT_FILES
from loraplex.registry import adapter_upload as upload_module
from loraplex.storage.base import open_blob_store
from tests.registry.adapter_manager_helpers import files_digest, make_manager


@pytest.fixture
def manager(registry, adapters, tmp_path):
    spec, _ = adapters
    return make_manager(registry, open_blob_store(str(tmp_path / "blobs")), tmp_path / "cache", spec)


def test_weights_rewritten_after_the_check_do_not_reach_the_blob(manager, adapters, tmp_path, monkeypatch):
    _, dirs = adapters
    work = tmp_path / "work"
    shutil.copytree(dirs["a"], work)
    real_inspect = upload_module.inspect_adapter_dir

    def inspect_then_rewrite(path, spec, max_rank):
        info = real_inspect(path, spec, max_rank)
        shutil.copyfile(dirs["b"] / WEIGHTS_NAME, work / WEIGHTS_NAME)  # another save lands now
        return info

    monkeypatch.setattr(upload_module, "inspect_adapter_dir", inspect_then_rewrite)
    version, _ = manager.upload("acme", "support", work)
    # the version names adapter a's content; what it serves must be exactly that content
    assert version.sha256 == compute_content_hash(dirs["a"])
    ref = manager.resolve("acme", "support")
    assert compute_content_hash(ref.path) == version.sha256
    original = files_digest(dirs["a"])
    assert files_digest(ref.path) == {name: original[name] for name in SNAPSHOT_FILES}


def test_an_unreadable_file_is_an_invalid_adapter_naming_it(manager, adapters, tmp_path):
    _, dirs = adapters
    work = tmp_path / "work"
    shutil.copytree(dirs["a"], work)
    (work / WEIGHTS_NAME).unlink()
    (work / WEIGHTS_NAME).mkdir()  # not a regular file: reading it fails
    with pytest.raises(InvalidAdapterError, match=WEIGHTS_NAME) as info:
        manager.upload("acme", "support", work)
    assert str(work) not in info.value.message  # the server's directory layout stays unsaid
    assert manager.registry.get_adapter("acme", "support") is None


def test_a_file_over_the_fetch_limit_is_refused_at_upload(registry, adapters, tmp_path):
    """A blob member above ``max_member_bytes`` is refused by every fetch (``unpack_files``), so
    an upload that stored one would register a version no request can use."""
    spec, dirs = adapters
    weights = (dirs["a"] / WEIGHTS_NAME).stat().st_size
    manager = make_manager(registry, open_blob_store(str(tmp_path / "blobs")), tmp_path / "cache", spec)
    manager.max_member_bytes = weights - 1
    with pytest.raises(InvalidAdapterError, match=f"{WEIGHTS_NAME} has {weights} bytes, above .* {weights - 1} "):
        manager.upload("acme", "support", dirs["a"])
    assert manager.registry.get_adapter("acme", "support") is None
    manager.max_member_bytes = weights  # at the limit: stored, and fetched back
    version, _ = manager.upload("acme", "support", dirs["a"])
    assert compute_content_hash(manager.resolve("acme", "support").path) == version.sha256


def test_an_adapter_may_not_take_the_served_base_models_name(manager, adapters, tmp_path):
    """A request's ``model`` naming the base model reaches the base model, so an adapter of that
    name would be reachable only as ``name@N``: refused (400 ``invalid_name``), nothing stored,
    by a single upload and by a batch (``upload_all_active``, as ``--lora-modules`` stores)."""
    from loraplex.registry.errors import InvalidName

    _, dirs = adapters
    manager.base_model_names = frozenset({"smollm2"})
    for upload in (lambda: manager.upload("acme", "smollm2", dirs["a"]),
                   lambda: manager.upload_all_active("acme", [("ok-name", dirs["a"]), ("smollm2", dirs["b"])], "admin")):
        with pytest.raises(InvalidName, match="'smollm2' is the served base model's name") as info:
            upload()
        assert info.value.http_status == 400
    assert manager.registry.list_adapters("acme") == []
    assert list(manager.blobs.list_blobs()) == []  # the name is checked before any blob is stored
    version, created = manager.upload("acme", "smollm2-sql", dirs["a"])  # a name beside it is fine
    assert created and version.version == 1


def test_the_copy_lives_in_the_snapshot_root_which_the_start_up_sweep_clears(manager, adapters, tmp_path,
                                                                              monkeypatch):
    """The private copy is taken under the manager's ``snapshot_root`` (the server's staging
    folder), not the system's /tmp: a process killed while it checked an upload left a copy of a
    tenant's weights there for good. The server's start-up sweep removes such leftovers."""
    import os
    import time

    from loraplex.lora.snapshot import SNAPSHOT_PREFIX
    from loraplex.server.uploads import STALE_STAGING_SECONDS, sweep_stale_staging

    _, dirs = adapters
    root = tmp_path / "staging"
    manager.snapshot_root = root
    seen = []
    real_inspect = upload_module.inspect_adapter_dir

    def inspect_and_look(path, spec, max_rank):
        seen.append(path)
        return real_inspect(path, spec, max_rank)

    monkeypatch.setattr(upload_module, "inspect_adapter_dir", inspect_and_look)
    manager.upload("acme", "support", dirs["a"])
    assert seen and seen[0].parent == root and seen[0].name.startswith(SNAPSHOT_PREFIX)
    assert list(root.iterdir()) == []  # removed once the upload is done

    # what a killed process left: an old copy is swept, a young one (another process's) stays
    old, young = root / f"{SNAPSHOT_PREFIX}old", root / f"{SNAPSHOT_PREFIX}young"
    for d in (old, young):
        d.mkdir()
        (d / WEIGHTS_NAME).write_bytes(b"weights")
    past = time.time() - STALE_STAGING_SECONDS - 60
    for p in (old / WEIGHTS_NAME, old):
        os.utime(p, (past, past))
    assert sweep_stale_staging(root) == [old]
    assert not old.exists() and young.exists()
