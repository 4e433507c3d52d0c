"""``RegistryService.apply_serve_flags``: the tenant, the ``--api-key`` keys and the modules'
versions of one ``loraplex serve`` start, written in one transaction; on SQLite and PostgreSQL.
(The start-up around it, blobs and messages included: tests/server/test_vllm_startup*.py.)"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from loraplex.registry.errors import Conflict, TenantDeleted


def written(registry) -> tuple:
    tenants = [t.name for t in registry.list_tenants()]
    keys = {t: [(k.id, k.revoked) for k in registry.list_api_keys(t)] for t in tenants}
    return tenants, keys, [(e.action, e.tenant, e.object_name) for e in registry.list_audit(limit=10_000)]


def start(registry, *keys: str, tenant: str = "default"):
    return registry.apply_serve_flags(tenant, list(keys), [], create_tenant=True, uploader="serve --lora-modules")


def test_the_tenant_is_created_once_and_audited_as_create_tenant(registry_service):
    first = start(registry_service, "sk-team")
    again = start(registry_service, "sk-team")
    assert (first.tenant_created, again.tenant_created) == (True, False)
    assert (again.keys.added, again.keys.kept, again.keys.revoked) == (0, 1, 0)
    registry_service.create_tenant("by-admin", actor="system")  # the reference: the admin's way
    created = [(e.actor, e.action, e.object_type, e.object_name) for e in registry_service.list_audit(limit=100)
               if e.action == "tenant.create"]
    assert created == [("system", "tenant.create", "tenant", "by-admin"), ("system", "tenant.create", "tenant",
                                                                            "default")]


def test_a_refused_key_creates_no_tenant(registry_service):
    start(registry_service, "sk-other", tenant="other")
    before = written(registry_service)
    with pytest.raises(Conflict, match="already a key of tenant 'other'"):
        start(registry_service, "sk-new", "sk-other")
    assert written(registry_service) == before
    assert registry_service.authenticate("sk-new") is None


def test_a_deleted_tenant_is_refused_and_nothing_is_written(registry_service):
    start(registry_service, "sk-team")
    registry_service.delete_tenant("default")
    before = written(registry_service)
    with pytest.raises(TenantDeleted, match="never reused"):
        start(registry_service, "sk-team-2")
    assert written(registry_service) == before


def test_replicas_starting_at_once_create_the_tenant_and_each_key_once(registry_service):
    barrier = threading.Barrier(4)

    def replica(_):
        barrier.wait()
        return start(registry_service, "sk-team", "sk-second")

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(replica, range(4)))
    assert sum(r.tenant_created for r in results) == 1
    assert sum(r.keys.added for r in results) == 2
    assert [t.name for t in registry_service.list_tenants()] == ["default"]
    assert [k.revoked for k in registry_service.list_api_keys("default")] == [False, False]
