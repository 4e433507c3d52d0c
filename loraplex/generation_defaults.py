"""Sampling defaults from the model's ``generation_config.json`` (vLLM's ``--generation-config``).

vLLM (since 0.8, vllm-project/vllm#12622) takes six fields of the model's generation config as
the defaults of a request that leaves them unset: ``temperature``, ``top_p``, ``top_k``,
``min_p``, ``repetition_penalty``, and ``max_new_tokens`` as the default ``max_tokens``
(``ModelConfig.get_diff_sampling_param``). Nothing else is read: ``do_sample: false`` does not
make requests greedy there, and neither does it here. The mode says where the file is:

* ``"auto"`` (default): the model directory's ``generation_config.json``, if it has one;
* ``"vllm"``: none, the library defaults (``SamplingParams``'s);
* a folder (or the file itself): that ``generation_config.json``; it must exist.

``override_generation_config`` (a JSON object, or a dict) sets any of the six over the file, in
every mode. A ``max_new_tokens`` that the operator chose (a folder's file, or the override) is
also a ceiling on every request's ``max_tokens``, as vLLM's ``override_max_tokens``; the model's
own (``"auto"``) is only a default, never a ceiling (vllm-project/vllm#34063).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

from loraplex.sampling_params import InvalidRequestError, SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
MODES = ("auto", "vllm")  # or a path
# generation-config field -> SamplingParams field
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
INT_FIELDS = ("top_k", "max_new_tokens")


class GenerationConfigError(ValueError):
    """A ``--generation-config`` / ``--override-generation-config`` that cannot be used; the
    message names the field or the file."""


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves a sampling field unset (absent or null) gets instead of the
    library default. ``max_tokens``: the default of an open ``max_tokens`` (still capped by the
    context); ``max_tokens_cap``: a ceiling on every request's ``max_tokens``."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    max_tokens_cap: int | None = None
    source: str = "vllm"  # where they came from, for the start-up line

    def sampling_fields(self) -> dict:
        """The sampling fields set (SamplingParams names), ``max_tokens`` included."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name not in ("max_tokens_cap", "source") and getattr(self, f.name) is not None}

    def __bool__(self) -> bool:
        return bool(self.sampling_fields()) or self.max_tokens_cap is not None

    def get(self, name: str, library_default):
        """The request's value of ``name`` when it left it unset."""
        value = getattr(self, name)
        return library_default if value is None else value

    def capped(self, max_tokens: int | None) -> int | None:
        """A request's explicit ``max_tokens`` under the operator's ceiling, if any."""
        if self.max_tokens_cap is None or max_tokens is None:
            return max_tokens
        return min(max_tokens, self.max_tokens_cap)

    def sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with these defaults (vLLM's ``LLM.get_default_sampling_params``)."""
        return SamplingParams(**self.sampling_fields())

    def describe(self) -> str:
        """One line: the fields taken and where from (the start-up log line and ``/admin/v1/status``)."""
        taken = ", ".join(f"{k}={v}" for k, v in self.sampling_fields().items())
        cap = f"; max_tokens at most {self.max_tokens_cap}" if self.max_tokens_cap is not None else ""
        return f"{taken}{cap} (from {self.source})"

    def to_dict(self) -> dict:
        return {**self.sampling_fields(), "max_tokens_cap": self.max_tokens_cap, "source": self.source}


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _typed(values: dict, where: str, *, strict_keys: bool) -> dict:
    """The six fields of ``values`` (JSON nulls dropped), type-checked. ``strict_keys``: any other
    key is an error (the override); a file may hold anything else (eos ids, do_sample...)."""
    if strict_keys:
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise GenerationConfigError(
                f"{where}: unknown field(s) {', '.join(map(repr, unknown))}; "
                f"the fields taken are {', '.join(FIELDS)}")
    out = {}
    for name in FIELDS:
        value = values.get(name)
        if value is None:
            continue
        if name in INT_FIELDS and not (isinstance(value, int) and not isinstance(value, bool)):
            raise GenerationConfigError(f"{where}: {name} must be an integer, got {value!r}")
        if not _is_number(value):
            raise GenerationConfigError(f"{where}: {name} must be a number, got {value!r}")
        out[name] = value
    return out


def _checked(values: dict, where: str) -> dict:
    """``values`` with each one in the range a request may set (SamplingParams's rules)."""
    for name, value in values.items():
        try:
            SamplingParams(**{FIELDS[name]: value})
        except InvalidRequestError as exc:
            message = exc.message.replace(FIELDS[name], name)  # the file's name for it
            raise GenerationConfigError(f"{where}: {name}={value!r}: {message}") from None
    return values


def parse_override(value) -> dict:
    """``--override-generation-config``: None, a JSON object (text) or a dict -> checked fields."""
    if value is None or value == "":
        return {}
    where = "--override-generation-config"
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise GenerationConfigError(f"{where}: not valid JSON ({exc}): {value!r}") from None
    if not isinstance(value, dict):
        raise GenerationConfigError(f"{where}: must be a JSON object such as '{{\"temperature\": 0.5}}'")
    return _checked(_typed(value, where, strict_keys=True), where)


def config_file(mode: str, model_dir: Path | None) -> Path | None:
    """The generation config file ``mode`` reads (None: none). A path that holds none is an error."""
    if mode == "vllm":
        return None
    if mode == "auto":
        path = Path(model_dir) / GENERATION_CONFIG_FILE if model_dir is not None else None
        return path if path is not None and path.is_file() else None
    path = Path(mode).expanduser()
    if path.is_dir():
        path = path / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise GenerationConfigError(
            f"--generation-config {mode!r}: no {GENERATION_CONFIG_FILE} there "
            "(give auto, vllm, or a folder that holds one)")
    return path


def read_config_file(path: Path) -> dict:
    """The six fields a generation config file sets, checked."""
    try:
        values = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise GenerationConfigError(f"{path}: cannot be read as JSON ({exc})") from None
    if not isinstance(values, dict):
        raise GenerationConfigError(f"{path}: must hold a JSON object")
    return _checked(_typed(values, str(path), strict_keys=False), str(path))


def check_options(mode: str, override) -> None:
    """What can be checked before the model is loaded: the override, and a folder's file."""
    parse_override(override)
    if mode not in MODES:
        read_config_file(config_file(mode, None))


def resolve(mode: str, model_dir: Path | None, override=None) -> SamplingDefaults:
    """The defaults ``mode`` (auto | vllm | a path) and ``override`` give for the model in
    ``model_dir``; raises ``GenerationConfigError`` naming what is wrong."""
    path = config_file(mode, model_dir)
    values = read_config_file(path) if path is not None else {}
    overridden = parse_override(override)
    values.update(overridden)
    sources = [str(path)] if path is not None and values.keys() - overridden.keys() else []
    if overridden:
        sources.append("--override-generation-config")
    chosen = mode not in MODES  # the operator named the file: its max_new_tokens is a ceiling
    cap = values.get("max_new_tokens") if chosen else overridden.get("max_new_tokens")
    kwargs = {FIELDS[name]: value for name, value in values.items()}
    return SamplingDefaults(**kwargs, max_tokens_cap=cap, source=" + ".join(sources) or "vllm")
