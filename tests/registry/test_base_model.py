"""The base-model spec the CLI validates uploads against, read from config only. The GGUF header
parser is checked against files written by the ``gguf`` package and, on the real SmolLM2 file,
against transformers' own GGUF config loader."""

from __future__ import annotations

import pytest

from loraplex.config import Settings
from loraplex.model.config import ModelSpec
from loraplex.registry.base_model import GGUFFormatError, base_model_spec, gguf_config


def _transformers_spec(gguf_path, name):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name).to_dict()
    return ModelSpec.from_dict(config, name=name).lora_target_spec()


def write_tiny_gguf(path, *, layers=3, hidden=64, ffn=96, heads=4, kv_heads=2, vocab=100, untied=False):
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(512)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(5000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"tok{i}" for i in range(vocab)])  # a string array the parser skips
    writer.add_token_types([1] * vocab)
    writer.add_tensor("token_embd.weight", np.zeros((vocab, hidden), dtype=np.float32))
    if untied:  # an lm_head of its own (llama.cpp's name for it)
        writer.add_tensor("output.weight", np.zeros((vocab, hidden), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_config_reads_what_the_writer_wrote(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", layers=3, hidden=64, ffn=96, heads=4, kv_heads=2, vocab=100)
    config = gguf_config(path)
    expected = dict(num_hidden_layers=3, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=100, max_position_embeddings=512, rope_theta=5000.0)
    assert {k: config[k] for k in expected} == expected
    spec = ModelSpec.from_dict(config, name="tiny").lora_target_spec()
    assert spec.module_shapes["k_proj"] == (64, 32) and spec.module_shapes["down_proj"] == (96, 64)
    assert spec.tied_embeddings  # no output.weight: the embedding is the head


def test_gguf_config_knows_a_head_of_its_own(tmp_path):
    """Tied or not decides whether an adapter may tie its lm_head LoRA to embed_tokens' (PEFT's
    ensure_weight_tying), so it must match what transformers reads from the same file."""
    from transformers import AutoConfig

    for untied in (False, True):
        path = write_tiny_gguf(tmp_path / f"m{int(untied)}.gguf", untied=untied)
        hf = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        assert gguf_config(path)["tie_word_embeddings"] is (not untied) is hf.tie_word_embeddings


def test_gguf_model_setting_uses_the_file_and_the_converted_copy(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "mymodel.gguf", hidden=32, ffn=48)
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("LORAPLEX_MODEL", str(path))
    spec = base_model_spec(Settings())
    assert spec.model_name == "mymodel" and spec.module_shapes["gate_proj"] == (32, 48)
    # once `loraplex serve` converted it, the converted config.json is used
    converted = tmp_path / "home" / "models" / "mymodel"
    converted.mkdir(parents=True)
    (converted / "config.json").write_text(
        '{"architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,'
        ' "num_attention_heads": 2, "vocab_size": 10}'
    )
    assert base_model_spec(Settings()).module_shapes["gate_proj"] == (16, 24)


def test_not_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(GGUFFormatError, match="not a GGUF file"):
        gguf_config(bad)


@pytest.mark.slow
@pytest.mark.realmodel
def test_default_model_spec_matches_transformers(tmp_path, monkeypatch):
    from loraplex.model.gguf import smollm2_gguf_path

    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path / "empty-home"))  # nothing converted yet
    monkeypatch.delenv("LORAPLEX_MODEL", raising=False)
    spec = base_model_spec(Settings())
    assert spec == _transformers_spec(smollm2_gguf_path(), "smollm2")
