"""What a model id names, found without reading or converting anything: the default model's GGUF
file, a ``.gguf`` file, or a Hugging Face directory. ``loader.resolve_model_dir`` goes on from
here; ``loraplex serve`` asks it first, so a wrong ``--model`` is said before anything starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loraplex.config import DEFAULT_MODEL, shown_model_name
from loraplex.model.gguf import ModelNotFoundError, is_converted, smollm2_gguf_path


@dataclass(frozen=True)
class ModelSource:
    """A model id's source: ``kind`` "gguf" (``path`` a file, converted on first use) or "dir"
    (``path`` a Hugging Face directory); ``name`` is what the model is shown as."""

    kind: str
    path: Path
    name: str


def locate_model(model: str | Path) -> ModelSource:
    """The source ``model`` names; raises ``ModelNotFoundError`` saying what is missing."""
    model_str = str(model)
    if model_str == DEFAULT_MODEL:
        return ModelSource("gguf", smollm2_gguf_path(), DEFAULT_MODEL)
    path = Path(model_str).expanduser()
    if model_str.endswith(".gguf"):
        if not path.is_file():
            raise ModelNotFoundError(f"GGUF file not found: {path}")
        return ModelSource("gguf", path, shown_model_name(model_str))
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return ModelSource("dir", path, shown_model_name(model_str))
    raise ModelNotFoundError(
        f"model {model_str!r} not found: give a local Hugging Face directory, a .gguf file, "
        f"or {DEFAULT_MODEL!r} (no downloads are made)"
    )


def described_dir(source: ModelSource, home: Path) -> Path | None:
    """The directory whose config.json describes the model, when there is one before any
    conversion: the model's own, or a GGUF file's conversion from an earlier start (None: not
    converted yet)."""
    if source.kind == "dir":
        return source.path
    converted = conversion_dir(source, home)
    return converted if is_converted(source.path, converted) else None


def conversion_dir(source: ModelSource, home: Path) -> Path:
    """Where a GGUF source is converted to a safetensors directory (once)."""
    return Path(home) / "models" / source.name
