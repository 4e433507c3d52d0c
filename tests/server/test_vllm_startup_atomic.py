"""``serve --lora-modules``: a start registers every module or none. A failure while registering
the third of five modules (the blob store refusing its blob, the database refusing its rows)
stops the start with an error naming that module, and leaves the registry's adapters and the
blob store exactly as they were before the start, also when earlier modules would have been
hot-swapped to new versions. The tenant and the ``--api-key`` keys are part of the same
all-or-none start: a failed start leaves no tenant it would have created and no key it would
have added or revoked. On SQLite and PostgreSQL."""

from __future__ import annotations

import shutil

import pytest

from loraplex.cli import build_parser
from loraplex.config import Settings
from loraplex.lora.peft_format import compute_content_hash
from loraplex.registry.adapter_manager import build_adapter_manager
from loraplex.registry.base_model import base_model_spec
from loraplex.registry.errors import Conflict
from loraplex.registry.service import RegistryService
from loraplex.server.vllm_flags import startup_flags
from loraplex.server.vllm_startup import StartupError, apply_startup_flags
from loraplex.storage.base import BlobStoreUnavailable
from tests.fixtures.peft_adapters import make_peft_adapter, tiny_llama
from tests.registry.adapter_manager_helpers import CountingStore

# tiny_llama_dir's shapes (tests/fixtures/tiny_models.py BASE_SHAPE) for peft's tiny Llama
MATCHING = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2)
NAMES = ("m1", "m2", "m3", "m4", "m5")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """Five modules' adapters, and a second set with other weights (a changed directory)."""
    root = tmp_path_factory.mktemp("atomic-modules")
    base = tiny_llama(seed=5, **MATCHING)
    first = {n: make_peft_adapter(base, root / n, seed=i) for i, n in enumerate(NAMES, start=1)}
    second = {n: make_peft_adapter(base, root / f"{n}-v2", seed=10 + i) for i, n in enumerate(NAMES, start=1)}
    return first, second


class PutFailsFor(CountingStore):
    """A blob store that refuses the put of one blob key."""

    def __init__(self, inner, key: str):
        super().__init__(inner)
        self.refused_key = key

    def put(self, key, stream, size):
        if key == self.refused_key:
            raise BlobStoreUnavailable("the store is full")
        self.inner.put(key, stream, size)


@pytest.fixture
def world(registry_url, tmp_path, tiny_llama_dir):
    settings = Settings(home=tmp_path / "home", database_url=registry_url, model=str(tiny_llama_dir), admin_key="x")
    return settings, RegistryService.from_url(registry_url)


def flags(paths: dict, key: str = "sk-team"):
    argv = ["serve", "m", "--api-key", key, "--lora-modules", *(f"{n}={p}" for n, p in paths.items())]
    return startup_flags(build_parser().parse_args(argv))


def what_is_registered(settings, registry) -> tuple:
    adapters = registry.list_adapters("default") if registry.get_tenant("default") else []
    blobs = settings.home / "blobs"
    files = sorted(str(p.relative_to(blobs)) for p in blobs.rglob("*") if p.is_file()) if blobs.exists() else []
    return adapters, files


def everything_written(settings, registry) -> tuple:
    """All a start can write: tenants, the tenant's keys (revoked ones too), its adapters, the
    blob files, and the audit trail (one event per write, any tenant)."""
    tenants = [t.name for t in registry.list_tenants()]
    keys = [(k.id, k.revoked) for k in registry.list_api_keys("default")] if "default" in tenants else []
    return (tenants, keys, *what_is_registered(settings, registry),
            [(e.action, e.tenant, e.object_name) for e in registry.list_audit(limit=10_000)])


def manager_with_store(settings, registry, wrap):
    def make():
        manager = build_adapter_manager(settings, registry, base_model_spec(settings))
        manager.blobs = wrap(manager.blobs)
        return manager
    return make


@pytest.mark.parametrize("earlier_start", [False, True], ids=["first-start", "restart-with-changes-and-a-new-key"])
def test_a_blob_the_store_refuses_registers_no_module(world, dirs, earlier_start):
    settings, registry = world
    first, second = dirs
    if earlier_start:  # all five served with sk-old; this start would swap each and rotate the key
        apply_startup_flags(flags(first, key="sk-old"), settings, registry)
    before = everything_written(settings, registry)
    refused = "sha256/" + compute_content_hash(second["m3"])
    with pytest.raises(StartupError) as caught:
        apply_startup_flags(flags(second, key="sk-new"), settings, registry,
                            make_adapter_manager=manager_with_store(settings, registry,
                                                                    lambda s: PutFailsFor(s, refused)))
    message = str(caught.value)
    assert message.startswith(f"--lora-modules m3={second['m3']} (tenant 'default'): ")
    assert "the store is full" in message and "none of the 5 module(s) was registered" in message
    assert everything_written(settings, registry) == before  # no tenant created, no key added or revoked
    assert registry.authenticate("sk-new") is None
    assert registry.authenticate("sk-old") == ("default" if earlier_start else None)
    if earlier_start:
        for name in NAMES:
            assert registry.resolve("default", name).sha256 == compute_content_hash(first[name])


@pytest.mark.parametrize("earlier_start", [False, True], ids=["first-start", "restart-with-changes-and-a-new-key"])
def test_a_database_failure_on_the_third_module_registers_none(world, dirs, earlier_start, monkeypatch):
    settings, registry = world
    first, second = dirs
    if earlier_start:
        apply_startup_flags(flags(first, key="sk-old"), settings, registry)
    before = everything_written(settings, registry)
    real_put = RegistryService._put_version

    def refuse_m3(session, tenant_row, name, *args):
        if name == "m3":
            raise Conflict("the database refused m3's row")
        return real_put(session, tenant_row, name, *args)

    monkeypatch.setattr(RegistryService, "_put_version", staticmethod(refuse_m3))
    with pytest.raises(StartupError, match=r"^--lora-modules m3=.*refused m3's row; none of the 5 module\(s\) "
                                           "was registered"):
        apply_startup_flags(flags(second, key="sk-new"), settings, registry)
    monkeypatch.undo()
    assert everything_written(settings, registry) == before
    assert registry.authenticate("sk-new") is None
    assert registry.authenticate("sk-old") == ("default" if earlier_start else None)
    # and the same start without the failure registers all five
    outcome = apply_startup_flags(flags(second, key="sk-new"), settings, registry)
    assert registry.authenticate("sk-new") == "default" and registry.authenticate("sk-old") is None
    assert [m.name for m in outcome.modules] == list(NAMES) and all(m.activated for m in outcome.modules)
    for name in NAMES:
        assert registry.resolve("default", name).sha256 == compute_content_hash(second[name])


def test_a_changed_module_among_unchanged_ones_swaps_only_that_one(world, dirs, tmp_path):
    settings, registry = world
    first, second = dirs
    apply_startup_flags(flags(first), settings, registry)
    events = len(registry.list_audit(limit=1000))
    changed = {**first, "m2": tmp_path / "m2"}
    shutil.copytree(second["m2"], changed["m2"])
    outcome = apply_startup_flags(flags(changed), settings, registry)
    assert [(m.name, m.version, m.created, m.activated) for m in outcome.modules] == [
        ("m1", 1, False, False), ("m2", 2, True, True), ("m3", 1, False, False), ("m4", 1, False, False),
        ("m5", 1, False, False)]
    audit = registry.list_audit(limit=1000)[: len(registry.list_audit(limit=1000)) - events]
    assert sorted(e.action for e in audit) == ["adapter.activate", "adapter.upload"]  # m2's alone


def test_a_key_refused_after_the_blobs_were_stored_leaves_nothing(world, dirs):
    """The key check runs in the start's one transaction, after the modules' blobs are stored:
    a key of another tenant refuses the start, and those blobs are removed again."""
    settings, registry = world
    first, _ = dirs
    registry.create_tenant("other")
    _, others_key = registry.create_api_key("other")
    before = everything_written(settings, registry)
    with pytest.raises(StartupError, match=r"^vLLM flags \(tenant 'default'\): --api-key #1 is already a key of "
                                           r"tenant 'other'"):
        apply_startup_flags(flags(first, key=others_key), settings, registry)
    assert everything_written(settings, registry) == before
    assert registry.authenticate(others_key) == "other"
