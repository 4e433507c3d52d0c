"""A multimodal Gemma 3 checkpoint behind the real app (tiny model, CPU, in process): uploads of
adapters trained on it answer with a warning when they carry LoRA on the vision tower, a
vision-only adapter is refused and stores nothing, and images are refused in the API's error
shape (``image_url`` parts, the image placeholder token, streamed or not). A Gemma 3 style chat
template renders text-part messages as it renders the same parts itself."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from starlette.testclient import TestClient
from transformers import Gemma3ForConditionalGeneration

from loraplex import LLM
from loraplex.config import Settings
from loraplex.engine.async_engine import AsyncLLMEngine
from loraplex.registry import db
from loraplex.registry.adapter_manager import AdapterManager
from loraplex.registry.service import RegistryService
from loraplex.server.app import create_app
from loraplex.server.generation import render_chat
from loraplex.server.protocol import parse_chat_request
from tests.fixtures.peft_adapters import make_peft_adapter
from tests.fixtures.tiny_gemma3_mm import IMAGE_TOKEN_ID, make_tiny_gemma3_mm_dir
from tests.fixtures.tiny_models import make_tiny_tokenizer

ADMIN_KEY = "gemma3-admin-key"
FILES = ("adapter_config.json", "adapter_model.safetensors")
IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
# Gemma 3's turn format, as its template lays it out: the system text opens the first user turn,
# the assistant speaks as "model", content is a string or a list of parts where an image part
# becomes <start_of_image> (the processor expands it) and text parts are trimmed
GEMMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}"
    "{%- set ns = namespace(prefix='', start=0) -%}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set c = messages[0]['content'] -%}"
    "{%- set ns.prefix = (c if c is string else c[0]['text']) + '\n\n' -%}{%- set ns.start = 1 -%}"
    "{%- endif -%}"
    "{%- for m in messages[ns.start:] -%}"
    "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{- ns.prefix if loop.first else '' -}}"
    "{%- if m['content'] is string -%}{{ m['content'] | trim }}"
    "{%- else -%}{%- for part in m['content'] -%}"
    "{%- if part['type'] == 'image' -%}<start_of_image>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}<end_of_turn>\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<start_of_turn>model\n{%- endif -%}"
)


def test_text_parts_render_as_the_template_renders_them():
    tok = make_tiny_tokenizer()
    tok.chat_template = GEMMA3_STYLE_TEMPLATE
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": " Name a colour. "}]},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And another?"},
    ]
    req = parse_chat_request({"model": "m", "messages": messages})
    ours = render_chat(tok, req.messages, req.tools.tools, req.prompt_options)
    assert ours == tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.count("<start_of_turn>") == 4 and "Be brief.\n\nName a colour." in ours
    # the template has an image path; loraplex never takes it
    with_image = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
    assert "<start_of_image>" in tok.apply_chat_template(with_image, tokenize=False)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3-mm-serving")
    model_dir = make_tiny_gemma3_mm_dir(root / "model", seed=11)
    base = Gemma3ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    adapters = {
        "all_linear": make_peft_adapter(base, root / "all_linear", seed=1, r=4, target_modules="all-linear"),
        "language": make_peft_adapter(base, root / "language", seed=2, r=4,
                                      target_modules=r".*language_model.*\.(q_proj|v_proj)"),
    }
    vision_only = shutil.copytree(adapters["all_linear"], root / "vision_only")
    tensors = load_file(str(vision_only / FILES[1]))
    save_file({n: t for n, t in tensors.items() if "vision_tower" in n}, str(vision_only / FILES[1]),
              metadata={"format": "pt"})
    adapters["vision_only"] = vision_only
    home = root / "home"
    llm = LLM(model=str(model_dir), dtype="float32", home=home, kv_cache_bytes=4 << 20, max_loras=2, max_lora_rank=8)
    engine = AsyncLLMEngine(llm.config, engine=llm.engine)
    url = f"sqlite:///{home / 'registry.db'}"
    db.upgrade(url)
    registry = RegistryService.from_url(url)
    manager = AdapterManager(registry, open_blobs(home), AdapterManager.make_disk_cache(home / "cache", 1 << 30),
                             llm.engine.runner.lora_target_spec(), 8)
    settings = Settings(home=home, admin_key=ADMIN_KEY, database_url=url, blob_gc_interval_seconds=0,
                        model=str(model_dir))
    registry.create_tenant("acme")
    _, key = registry.create_api_key("acme")
    with TestClient(create_app(settings, engine=engine, registry=registry, adapters=manager)) as client:
        client.headers["Authorization"] = f"Bearer {ADMIN_KEY}"
        yield client, {"Authorization": f"Bearer {key}"}, adapters


def open_blobs(home):
    from loraplex.storage.base import open_blob_store

    return open_blob_store(str(home / "blobs"))


def _upload(client, name, path):
    return client.post(f"/admin/v1/tenants/acme/adapters/{name}/versions",
                       files={n: (n, (path / n).read_bytes()) for n in FILES})


def test_uploads_warn_about_vision_lora_and_refuse_vision_only(world):
    client, _, adapters = world
    r = _upload(client, "all-linear", adapters["all_linear"])
    assert r.status_code == 201, r.text
    assert len(r.json()["warnings"]) == 1 and "vision_tower" in r.json()["warnings"][0]
    assert set(r.json()["targets"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    r = _upload(client, "language", adapters["language"])
    assert r.status_code == 201 and "warnings" not in r.json()
    r = _upload(client, "vision", adapters["vision_only"])
    assert r.status_code == 400 and "does not run" in r.json()["error"]["message"]
    names = [a["name"] for a in client.get("/admin/v1/tenants/acme/adapters").json()["data"]]
    assert "vision" not in names and {"all-linear", "language"} <= set(names)


@pytest.mark.parametrize("stream", [False, True])
def test_images_are_refused_in_the_error_shape(world, stream):
    client, tenant, _ = world
    chat = {"model": "all-linear", "stream": stream, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE_PART]}]}
    r = client.post("/v1/chat/completions", headers=tenant, json=chat)
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = client.post("/v1/completions", headers=tenant,
                    json={"model": "all-linear", "stream": stream, "max_tokens": 2, "prompt": [5, IMAGE_TOKEN_ID]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "prompt" and "image placeholder" in error["message"]


def test_text_parts_chat_with_an_adapter_answers(world):
    client, tenant, adapters = world
    if _upload(client, "lang2", adapters["language"]).status_code not in (200, 201):
        pytest.fail("upload failed")
    answers = []
    for content in ([{"type": "text", "text": "hello"}], "hello"):
        r = client.post("/v1/chat/completions", headers=tenant,
                        json={"model": "lang2", "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                              "messages": [{"role": "user", "content": content}]})
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"]["content"])
    assert answers[0] == answers[1]
