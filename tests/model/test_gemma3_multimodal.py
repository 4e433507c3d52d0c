"""Gemma 3's multimodal checkpoints (``Gemma3ForConditionalGeneration``) served as their text
model, against transformers' ``Gemma3ForConditionalGeneration`` text-only forward on the same
tiny random checkpoint (float32, CPU, eager attention): the config read as transformers reads
it, logits and greedy tokens under both weight namings, tied and untied heads, and not one tensor
of the vision tower or projector read from the safetensors file."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration

from loraplex.model import loader
from loraplex.model.config import ModelSpec, UnsupportedModelError
from loraplex.model.loader import load_model
from loraplex.sampling_params import InvalidRequestError, SamplingParams
from tests.engine.test_engine_exact import tight_llm
from tests.fixtures.tiny_gemma3_mm import (
    IMAGE_TOKEN_ID, checkpoint_keys, make_tiny_gemma3_mm_dir, tiny_gemma3_mm_config, to_module_tree_naming,
)
from tests.lora.test_acceptance import greedy
from tests.model.test_gemma import prefill_logits, ref_logits
from tests.model.helpers import relative_error

UNSERVED = ("vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.")
# gemma-3-4b-it's config.json, less the vision tower's and initializer keys: text_config leaves
# most keys to Gemma3TextConfig's defaults, and eos / dtype live at the top level
HUB_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "boi_token_index": 255999, "eoi_token_index": 256000, "image_token_index": 262144,
    "eos_token_id": [1, 106], "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text", "hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024,
    },
    "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                      "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                      "patch_size": 14, "vision_use_head": False},
}


def test_hub_config_reads_as_transformers_does():
    spec = ModelSpec.from_dict(HUB_4B_IT)
    hf = Gemma3Config(**{k: v for k, v in HUB_4B_IT.items() if k not in ("architectures", "model_type")})
    text = hf.text_config
    assert spec.architecture == "Gemma3ForConditionalGeneration"
    assert (spec.vocab_size, spec.hidden_size, spec.num_layers) == (text.vocab_size, text.hidden_size, 34)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size) == (
        text.num_attention_heads, text.num_key_value_heads, text.head_dim, text.intermediate_size)
    assert spec.rms_norm_eps == text.rms_norm_eps and spec.gemma.gelu_approximate == "tanh"
    assert spec.gemma.layer_types == tuple(text.layer_types)
    full, local = text.rope_parameters["full_attention"], text.rope_parameters["sliding_attention"]
    assert (spec.rope.rope_type, spec.rope.theta, spec.rope.scaling["factor"]) == ("linear", full["rope_theta"], 8.0)
    assert spec.gemma.rope_local.theta == local["rope_theta"]
    assert spec.gemma.sliding_window == text.sliding_window == 1024
    assert spec.max_position_embeddings == text.max_position_embeddings
    assert spec.softmax_scale == text.query_pre_attn_scalar**-0.5
    assert spec.eos_token_ids == (1, 106) and spec.bos_token_id == text.bos_token_id
    assert spec.checkpoint_dtype == "bfloat16"
    assert spec.tie_word_embeddings is hf.tie_word_embeddings is True
    assert spec.image_token_id == hf.image_token_id == 262144
    # the LoRA targets are the text model's; the vision tower is named as not served
    target = spec.lora_target_spec()
    assert target.num_layers == 34 and target.module_shapes["q_proj"] == (2560, 8 * 256)
    assert set(target.unserved_module_prefixes) == set(UNSERVED)


def test_model_type_alone_names_the_architecture():
    cfg = {k: v for k, v in HUB_4B_IT.items() if k != "architectures"}
    assert ModelSpec.from_dict(cfg).architecture == "Gemma3ForConditionalGeneration"


@pytest.mark.parametrize("top_level, text_level", [(False, True), (True, False)])
def test_top_level_tie_decides_as_in_transformers(top_level, text_level):
    config = tiny_gemma3_mm_config(tie_word_embeddings=top_level)
    config.text_config.tie_word_embeddings = text_level
    model = Gemma3ForConditionalGeneration(config)
    tied = model.lm_head.weight is model.model.language_model.embed_tokens.weight
    assert tied is top_level
    assert ModelSpec.from_dict(config.to_dict()).tie_word_embeddings is tied


def test_other_text_model_is_refused():
    cfg = {**HUB_4B_IT, "text_config": {**HUB_4B_IT["text_config"], "model_type": "gemma2"}}
    with pytest.raises(UnsupportedModelError, match="gemma3_text"):
        ModelSpec.from_dict(cfg)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(naming, tied) -> directory: each model saved once in the hub naming and copied into the other."""
    out = {}
    for tied in (True, False):
        hub = make_tiny_gemma3_mm_dir(tmp_path_factory.mktemp(f"hub-{tied}"), seed=3, tie_word_embeddings=tied)
        tree = tmp_path_factory.mktemp(f"tree-{tied}")
        shutil.copytree(hub, tree, dirs_exist_ok=True)
        to_module_tree_naming(tree)
        out[("hub", tied)], out[("module_tree", tied)] = hub, tree
    return out


@pytest.mark.parametrize("naming", ["hub", "module_tree"])
@pytest.mark.parametrize("tied", [True, False])
def test_prefill_logits_match_transformers(checkpoints, naming, tied):
    model_dir = checkpoints[(naming, tied)]
    prefix = "language_model.model." if naming == "hub" else "model.language_model."
    assert any(k.startswith(prefix) for k in checkpoint_keys(model_dir))
    spec = ModelSpec.from_dir(model_dir)
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=512)
    ref = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    assert (ours.lm_head is None) is tied
    tokens = torch.randint(4, 300, (150,), generator=torch.Generator().manual_seed(0)).tolist()
    assert relative_error(prefill_logits(ours, spec, tokens), ref_logits(ref, tokens)) < 1e-4


@pytest.mark.parametrize("naming", ["hub", "module_tree"])
def test_no_vision_tensor_is_read(checkpoints, naming, monkeypatch):
    """The loader asks safetensors for the language model's tensors only, and holds as many
    parameters as transformers' language model (plus the head when untied)."""
    model_dir = checkpoints[(naming, False)]
    read: list[str] = []
    real_open = loader.safe_open

    class RecordingOpen:
        def __init__(self, *args, **kwargs):
            self.inner = real_open(*args, **kwargs)

        def __enter__(self):
            self.file = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_tensor(self, name):
            read.append(name)
            return self.file.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", RecordingOpen)
    spec = ModelSpec.from_dir(model_dir)
    ours = load_model(model_dir, spec, torch.float32, "cpu", max_positions=64)
    all_keys = checkpoint_keys(model_dir)
    vision = [k for k in all_keys if k.startswith(UNSERVED)]
    assert vision and not [k for k in read if k.startswith(UNSERVED)]
    assert sorted(read) == sorted(k for k in all_keys if not k.startswith(UNSERVED))
    ref = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32)
    language = sum(p.numel() for p in ref.model.language_model.parameters()) + ref.lm_head.weight.numel()
    # loraplex stores q_norm / k_norm once per head (qk_norm): count them once per module
    per_head_norms = spec.num_layers * (spec.num_heads + spec.num_kv_heads - 2) * spec.head_dim
    assert sum(p.numel() for p in ours.parameters()) - per_head_norms == language


def test_greedy_generation_matches_transformers(checkpoints, loraplex_home):
    """Through the engine: chunked prompts, then decodes past the 24-position window."""
    model_dir = checkpoints[("module_tree", True)]
    ref = Gemma3ForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(4, 300, (n,), generator=gen).tolist() for n in (3, 17, 90, 41)]
    llm = tight_llm(model_dir, loraplex_home, num_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [greedy(ref, p, 10) for p in prompts]
    # the image placeholder stands for vision features that are never computed: refused
    with pytest.raises(InvalidRequestError, match="image placeholder"):
        llm.generate([[5, IMAGE_TOKEN_ID, 6]], SamplingParams(max_tokens=2))
    assert llm.generate([[5, 6]], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))[0].token_ids
