"""The served base model's LoRA target shapes, for validating uploads outside the server.

``base_model_spec(settings, base_config=None)`` reads only the model's config: the model
directory's ``config.json``, the converted copy under ``LORAPLEX_HOME/models/<name>`` (what
``loraplex serve`` writes on first start), or, failing both, the GGUF file's metadata. GGUF
metadata is read by a small header parser (``gguf_config``) that skips the tokenizer arrays
instead of decoding them: the general GGUF readers decode every token string and take tens of
seconds on SmolLM2's file, which would make ``loraplex adapters upload`` crawl.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, BinaryIO

from loraplex.config import DEFAULT_MODEL, shown_model_name
from loraplex.lora.spec import LoRATargetSpec

# GGUF value types: id -> struct format of a scalar (8: string, 9: array are handled apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


class GGUFFormatError(ValueError):
    """Not a GGUF file loraplex can read the config from."""


def _read(handle: BinaryIO, fmt: str):
    size = struct.calcsize(fmt)
    data = handle.read(size)
    if len(data) != size:
        raise GGUFFormatError("GGUF file ends inside its header")
    return struct.unpack(fmt, data)[0]


def _read_string(handle: BinaryIO) -> str:
    length = _read(handle, "<Q")
    if length > 1 << 24:
        raise GGUFFormatError(f"GGUF string of {length} bytes")
    return handle.read(length).decode("utf-8", errors="replace")


def _read_value(handle: BinaryIO, kind: int) -> Any:
    """A scalar or string; arrays are skipped and returned as their element count."""
    if kind in _SCALARS:
        return _read(handle, _SCALARS[kind])
    if kind == _STRING:
        return _read_string(handle)
    if kind == _ARRAY:
        element, count = _read(handle, "<I"), _read(handle, "<Q")
        if element in _SCALARS:
            handle.seek(struct.calcsize(_SCALARS[element]) * count, 1)
        elif element == _STRING:
            for _ in range(count):
                handle.seek(_read(handle, "<Q"), 1)
        else:
            for _ in range(count):
                _read_value(handle, element)
        return count
    raise GGUFFormatError(f"unknown GGUF value type {kind}")


def gguf_metadata(path: str | Path) -> dict[str, Any]:
    """GGUF key-value metadata (arrays replaced by their length)."""
    return _gguf_header(path, with_tensor_names=False)[0]


def _gguf_header(path: str | Path, with_tensor_names: bool) -> tuple[dict[str, Any], set[str]]:
    """The key-value metadata and, when asked, the names in the tensor-info table that follows it."""
    with open(path, "rb") as handle:
        if handle.read(4) != b"GGUF":
            raise GGUFFormatError(f"{path} is not a GGUF file")
        version = _read(handle, "<I")
        if version < 2:
            raise GGUFFormatError(f"GGUF version {version} is too old")
        tensor_count, kv_count = _read(handle, "<Q"), _read(handle, "<Q")
        metadata = {}
        for _ in range(kv_count):
            key = _read_string(handle)
            metadata[key] = _read_value(handle, _read(handle, "<I"))
        names: set[str] = set()
        if with_tensor_names:
            for _ in range(tensor_count):  # name, n_dims, dims (uint64 each), type, offset
                names.add(_read_string(handle))
                handle.seek(8 * _read(handle, "<I") + 4 + 8, 1)
        return metadata, names


def gguf_config(path: str | Path) -> dict[str, Any]:
    """A Hugging Face style ``config.json`` dict from a GGUF file's metadata (shape fields)."""
    meta, tensor_names = _gguf_header(path, with_tensor_names=True)
    arch = meta.get("general.architecture")
    if arch not in _GGUF_ARCHITECTURES:
        raise GGUFFormatError(f"GGUF architecture {arch!r} is not supported ({', '.join(_GGUF_ARCHITECTURES)})")

    def field(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise GGUFFormatError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden, heads = int(field("embedding_length")), int(field("attention.head_count"))
    config = {
        "architectures": [_GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(field("feed_forward_length")),
        "num_hidden_layers": int(field("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(field("attention.head_count_kv", heads)),
        "head_dim": int(field("attention.key_length", hidden // heads)),
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or meta.get("tokenizer.ggml.tokens") or 0),
        "max_position_embeddings": int(field("context_length", 2048)),
        "rms_norm_eps": float(field("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(field("rope.freq_base", 10000.0)),
        # llama.cpp writes no output.weight for a model whose lm_head is the embedding
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    return config


def base_model_spec(settings, base_config: str | Path | None = None) -> LoRATargetSpec:
    """LoRA target shapes of ``settings.model`` (a ``loraplex.config.Settings``), named as the
    engine names the model (``loraplex.model.loader.resolve_model_dir``'s display name); an MoE
    model's experts take LoRA where ``settings.enable_expert_lora`` says the engine serves it."""
    from loraplex.model.config import ModelSpec

    experts = bool(getattr(settings, "enable_expert_lora", False))

    model = str(settings.model)
    path = Path(model).expanduser()
    name = shown_model_name(model)
    converted = model == DEFAULT_MODEL or model.endswith(".gguf")  # under home, by its shown name
    config_dir = Path(settings.home) / "models" / name if converted else path
    gguf: Path | None = path if model.endswith(".gguf") else None
    if base_config is not None:
        return ModelSpec.from_dict(json.loads(Path(base_config).read_text()), name=name).lora_target_spec(experts)
    if (config_dir / "config.json").is_file():
        return ModelSpec.from_dir(config_dir, name=name).lora_target_spec(experts)
    if model == DEFAULT_MODEL:
        from loraplex.model.gguf import smollm2_gguf_path

        gguf = smollm2_gguf_path()
    if gguf is not None:
        if not gguf.is_file():
            raise FileNotFoundError(f"GGUF file not found: {gguf}")
        return ModelSpec.from_dict(gguf_config(gguf), name=name).lora_target_spec()
    raise FileNotFoundError(
        f"base model {model!r} has no config.json; set LORAPLEX_MODEL or pass --base-config"
    )
