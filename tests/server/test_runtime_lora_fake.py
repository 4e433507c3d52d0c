"""vLLM's runtime LoRA endpoints (``POST /v1/load_lora_adapter``, ``/v1/unload_lora_adapter``) over
the fake engine, with the real AdapterManager (PEFT adapters made by peft, validated as uploads
are) and a real SQLite registry: answers against vLLM's documented texts and error objects, and
what the registry and blob store hold afterwards."""

from __future__ import annotations

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from loraplex.lora.peft_format import compute_content_hash
from loraplex.server import runtime_lora_routes
from loraplex.storage.base import content_key, open_blob_store
from tests.fixtures.peft_adapters import make_peft_adapter, tiny_llama
from tests.registry.adapter_manager_helpers import build_adapters, make_manager
from tests.server.conftest import start_server
from tests.server.fakes import FakeEngine

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """``(spec, root, dirs)``: adapters a, b, big, wrong and solo (used by one test only, so its
    blob is no other version's) under ``root`` (the allowed root), and ``outside``, elsewhere."""
    root = tmp_path_factory.mktemp("lora-root")
    spec, dirs = build_adapters(root)
    solo = make_peft_adapter(tiny_llama(seed=11), root / "solo", seed=9)
    outside = make_peft_adapter(tiny_llama(seed=11), tmp_path_factory.mktemp("not-allowed") / "a", seed=1)
    return spec, root, {**dirs, "solo": solo, "outside": outside}


@pytest.fixture(scope="module")
def srv(tmp_path_factory, adapters):
    spec, root, _ = adapters

    def make(registry, home):
        return make_manager(registry, open_blob_store(str(home / "blobs")), home / "cache", spec)

    server = start_server(tmp_path_factory.mktemp("runtime-lora"), FakeEngine(step_seconds=0.02), make,
                          allow_runtime_lora_updating=True, lora_path_roots=[root])
    yield server
    server.stop()


_tenants = iter(range(1000))


@pytest.fixture
def tenant(srv) -> tuple[str, httpx.Client]:
    name = f"team{next(_tenants)}"
    client = srv.tenant_client(srv.make_tenant(name))
    yield name, client
    client.close()


def _chat(client: httpx.Client, model: str, base: str = "/v1") -> httpx.Response:
    return client.post(base + "/chat/completions",
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def test_off_by_default_the_routes_do_not_exist(fake_server, adapters):
    key = fake_server.make_tenant("acme")
    with fake_server.tenant_client(key) as c:
        for path, body in ((LOAD, {"lora_name": "sql", "lora_path": str(adapters[2]["a"])}),
                           (UNLOAD, {"lora_name": "sql"})):
            r = c.post(path, json=body)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert fake_server.registry.get_adapter("acme", "sql") is None


def test_load_makes_the_adapter_usable_in_the_keys_tenant(srv, adapters, tenant):
    name, client = tenant
    path = adapters[2]["a"]
    r = client.post(LOAD, json={"lora_name": "sql", "lora_path": str(path)})
    assert r.status_code == 200 and r.text == "Success: LoRA adapter 'sql' added successfully."
    version = srv.registry.resolve(name, "sql")
    assert version.sha256 == compute_content_hash(path) and version.uploader == "load_lora_adapter"
    assert srv.adapters.blobs.exists(content_key(version.sha256))
    assert "sql" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    chat = _chat(client, "sql")
    assert chat.status_code == 200, chat.text
    assert srv.engine.started[-1][1] == version.sha256  # the request ran on those weights


def test_a_loaded_name_is_refused_as_in_vllm_unless_load_inplace(srv, adapters, tenant):
    name, client = tenant
    dirs = adapters[2]
    assert client.post(LOAD, json={"lora_name": "sql", "lora_path": str(dirs["a"])}).status_code == 200
    again = client.post(LOAD, json={"lora_name": "sql", "lora_path": str(dirs["b"])})
    assert again.status_code == 400
    assert again.json() == {"error": {"message": "The lora adapter 'sql' has already been loaded.",
                                      "type": "BadRequestError", "param": None, "code": 400}}
    assert [v.version for v in srv.registry.get_adapter(name, "sql").versions] == [1]
    swap = client.post(LOAD, json={"lora_name": "sql", "lora_path": str(dirs["b"]), "load_inplace": True})
    assert swap.status_code == 200
    adapter = srv.registry.get_adapter(name, "sql")
    assert adapter.active_version == 2 and adapter.versions[1].sha256 == compute_content_hash(dirs["b"])


def test_concurrent_loads_of_a_new_name_add_it_once(srv, adapters, tenant):
    """Four loads at once without ``load_inplace``: each passed the route's "already loaded"
    check before any wrote, so all four answered success and two versions were added; the
    registry now decides under its lock, and the others get vLLM's answer."""
    name, client = tenant
    dirs = adapters[2]
    barrier = threading.Barrier(4)

    def load(which):
        barrier.wait()
        return client.post(LOAD, json={"lora_name": "race", "lora_path": str(dirs[which])})

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(load, ["a", "b", "a", "b"]))
    assert sorted(r.status_code for r in answers) == [200, 400, 400, 400], [r.text for r in answers]
    assert {r.json()["error"]["message"] for r in answers if r.status_code == 400} == {
        "The lora adapter 'race' has already been loaded."}
    assert [v.version for v in srv.registry.get_adapter(name, "race").versions] == [1]


def test_missing_fields_get_vllms_errors(srv, tenant):
    _, client = tenant
    for body in ({}, {"lora_name": "sql"}, {"lora_path": "/x"}, {"lora_name": 3, "lora_path": "/x"}):
        r = client.post(LOAD, json=body)
        assert r.status_code == 400 and r.json()["error"] == {
            "message": "Both 'lora_name' and 'lora_path' must be provided.", "type": "BadRequestError",
            "param": None, "code": 400}
    r = client.post(UNLOAD, json={})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "'lora_name' needs to be provided to unload a LoRA adapter."
    assert client.post(LOAD, content=b"not json").status_code == 400


def test_paths_outside_the_roots_are_refused_alike_whether_or_not_they_exist(srv, adapters, tenant, tmp_path):
    name, client = tenant
    _, root, dirs = adapters
    link = root / f"link-{name}"
    link.symlink_to(dirs["outside"], target_is_directory=True)  # inside by name, outside in fact
    linked_files = root / f"files-{name}"  # a directory inside whose weights file lives outside
    linked_files.mkdir()
    shutil.copy(dirs["outside"] / "adapter_config.json", linked_files)
    (linked_files / "adapter_model.safetensors").symlink_to(dirs["outside"] / "adapter_model.safetensors")
    answers = []
    for path in (str(dirs["outside"]), str(tmp_path / "does-not-exist"), str(link), "a", str(root / ".." / "x"),
                 str(linked_files)):
        r = client.post(LOAD, json={"lora_name": "sql", "lora_path": path})
        assert r.status_code == 403, path
        answers.append(r.json())
    assert all(a == answers[0] for a in answers)  # nothing tells an existing path from a missing one
    assert answers[0]["error"]["code"] == "lora_path_not_allowed" and str(tmp_path) not in json.dumps(answers[0])
    assert srv.registry.list_adapters(name) == []


def test_an_invalid_adapter_is_refused_with_nothing_registered(srv, adapters, tenant):
    name, client = tenant
    blobs_before = sorted(b.key for b in srv.adapters.blobs.list_blobs("sha256/"))
    r = client.post(LOAD, json={"lora_name": "bad", "lora_path": str(adapters[2]["wrong"])})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_adapter"
    big = client.post(LOAD, json={"lora_name": "big", "lora_path": str(adapters[2]["big"])})  # rank 32 > 16
    assert big.status_code == 400 and "rank" in big.json()["error"]["message"]
    assert srv.registry.list_adapters(name) == []
    assert sorted(b.key for b in srv.adapters.blobs.list_blobs("sha256/")) == blobs_before


def test_another_tenant_can_neither_see_nor_unload_it(srv, adapters, tenant):
    name, client = tenant
    other = srv.tenant_client(srv.make_tenant(f"{name}-other"))
    assert client.post(LOAD, json={"lora_name": "sql", "lora_path": str(adapters[2]["a"])}).status_code == 200
    assert "sql" not in [m["id"] for m in other.get("/v1/models").json()["data"]]
    assert _chat(other, "sql").status_code == 404
    r = other.post(UNLOAD, json={"lora_name": "sql"})
    assert r.status_code == 404 and r.json() == {"error": {
        "message": "The lora adapter 'sql' cannot be found.", "type": "NotFoundError", "param": None, "code": 404}}
    assert other.post(f"/t/{name}/v1/unload_lora_adapter", json={"lora_name": "sql"}).status_code == 401
    assert srv.registry.get_adapter(name, "sql") is not None
    other.close()


def test_unload_removes_it_and_a_running_request_finishes_first(srv, adapters, tenant):
    name, client = tenant
    path = adapters[2]["solo"]
    base = f"/t/{name}/v1"  # the tenant-in-path forms answer too
    assert client.post(base + "/load_lora_adapter", json={"lora_name": "chat", "lora_path": str(path)}).status_code == 200
    sha = compute_content_hash(path)
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["model"] == "chat"
        r = client.post(UNLOAD, json={"lora_name": "chat"})  # while the stream runs (~0.8 s)
        assert r.status_code == 200 and r.text == "Success: LoRA adapter 'chat' removed successfully."
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    finish = [json.loads(line[6:])["choices"][0]["finish_reason"] for line in rest[:-1] if json.loads(line[6:])["choices"]]
    assert finish[-1] == "length"  # all 40 tokens: not cut short by the unload
    assert srv.registry.get_adapter(name, "chat") is None
    assert _chat(client, "chat").status_code == 404
    assert client.post(UNLOAD, json={"lora_name": "chat"}).status_code == 404
    deadline = time.monotonic() + 5  # its blob goes once the request released it
    while srv.adapters.blobs.exists(content_key(sha)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not srv.adapters.blobs.exists(content_key(sha))


def test_a_key_is_needed(srv):
    with httpx.Client(base_url=srv.url) as c:
        assert c.post(LOAD, json={"lora_name": "x", "lora_path": "/x"}).status_code == 401
        assert c.post(UNLOAD, json={"lora_name": "x"}).status_code == 401


def test_a_file_swapped_for_a_link_out_after_the_path_check_is_refused(srv, adapters, tenant, monkeypatch):
    """The path is checked, then read: a tenant who can write under the root must not get a file
    from outside it read by swapping in a link between the two."""
    name, client = tenant
    _, root, dirs = adapters
    work = root / f"swap-{name}"
    shutil.copytree(dirs["b"], work)
    weights = "adapter_model.safetensors"
    real_check = runtime_lora_routes.allowed_path

    def check_then_swap(path, roots):
        allowed = real_check(path, roots)
        (work / weights).unlink()
        (work / weights).symlink_to(dirs["outside"] / weights)
        return allowed

    monkeypatch.setattr(runtime_lora_routes, "allowed_path", check_then_swap)
    r = client.post(LOAD, json={"lora_name": "sql", "lora_path": str(work)})
    refused = client.post(LOAD, json={"lora_name": "sql", "lora_path": str(dirs["outside"])})
    assert r.status_code == refused.status_code == 403 and r.json() == refused.json()
    assert srv.registry.list_adapters(name) == []
