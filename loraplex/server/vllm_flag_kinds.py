"""The pieces rows of loraplex's table of vLLM flags (loraplex/server/vllm_flag_table.py) are made
of: ``EngineFlag`` (a flag, its argparse options, which values mean what loraplex does, the note
logged when taken and the reason when refused), three ways to build one (``taken``, ``taken_if``,
``refused``), the argparse options vLLM's flags take (``BOOL``, ``INT``, ``JSON``...) and the
reasons several rows share."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# one device per process: what loraplex says instead of any form of parallelism
ONE_DEVICE = ("loraplex runs a model on one device (--device cuda:N); to use more GPUs run one replica "
              "per GPU on a shared database and blob store (LORAPLEX_DATABASE_URL, LORAPLEX_BLOB_URL)")
NO_DOWNLOADS = ("loraplex makes no downloads: fetch the model first (`huggingface-cli download MODEL "
                "--revision REV --local-dir DIR`) and serve DIR")
# why a flag that only matters across devices changes nothing here
ACROSS_DEVICES = "only matters across devices (tensor, data or expert parallel ranks); loraplex runs one"
# why a multimodal setting changes nothing here
TEXT_ONLY = "a multimodal setting; loraplex serves text only (image, audio and video parts are a 400)"
NO_GENERATION_ONLY = ("loraplex serves text generation only (completions, chat, responses): no pooling, "
                      "embedding, classification or scoring models")
NO_TRACING = ("loraplex exports no OpenTelemetry traces: correlate requests by x-request-id (in each JSON "
              "access line) and watch the vllm:* metrics on /metrics")
NO_PLUGINS = "loraplex loads no code by import path (plugins, custom classes): it runs its own"


@dataclass(frozen=True)
class EngineFlag:
    """One vLLM flag: ``takes(value)`` says whether its value means what loraplex does (then
    ``note`` is logged at start), else ``refusal`` says why not and what to use instead."""

    flags: tuple[str, ...]
    options: dict
    takes: Callable[[Any], bool]
    note: str
    refusal: str = ""


def _equals(*values) -> Callable[[Any], bool]:
    return lambda value: value in values


def _always(_value) -> bool:
    return True


def _never(_value) -> bool:
    return False


def _off(value) -> bool:
    """A switch given as ``--no-X`` (False): off, which is what loraplex does."""
    return value is False


def _empty(value) -> bool:
    return not value


def _text_only(value: dict) -> bool:
    return all(count == 0 for count in value.values())


def mm_limits(text: str) -> dict[str, int]:
    """``--limit-mm-per-prompt``: vLLM's JSON object (``{"image": 0}``, a count or an object with
    ``count``) or its older ``image=0,video=0`` form -> modality -> count."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError:
        try:
            raw = {k.strip(): int(v) for k, v in (item.split("=", 1) for item in text.split(",") if item.strip())}
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object or modality=count,...") from None
    if not isinstance(raw, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    limits = {}
    for modality, limit in raw.items():
        count = limit.get("count") if isinstance(limit, dict) else limit
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise argparse.ArgumentTypeError(f"{text!r}: {modality}: expected a count >= 0")
        limits[modality] = count
    return limits


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {text!r}: {exc.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a JSON object")
    return value


def compilation_config(text: str) -> dict:
    """``--compilation-config``: a JSON object, or vLLM's bare level (``--compilation-config 3``,
    what older vLLM's ``-O3`` stood for) as ``{"level": 3}``."""
    if text.strip().isdigit():
        return {"level": int(text)}
    return json_object(text)


def human_readable_int(text: str) -> int:
    """vLLM's ``--max-model-len`` values: ``4096``, or with a suffix: ``k``/``m``/``g``/``t`` are
    powers of 1000 (decimals allowed: ``25.6k``), ``K``/``M``/``G``/``T`` powers of 1024 (whole
    numbers), as vLLM's ``human_readable_int``."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid integer: {text!r}") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** ("kmgt".index(suffix) + 1))
    if "." in number:
        raise argparse.ArgumentTypeError(f"{text!r}: a binary suffix ({suffix}) takes a whole number")
    return int(number) * 1024 ** ("KMGT".index(suffix) + 1)


# argparse options of vLLM's flag kinds
BOOL = {"action": argparse.BooleanOptionalAction}  # --X and --no-X, as vLLM's bool fields
INT = {"type": int}
FLOAT = {"type": float}
STR: dict = {}
JSON = {"type": json_object}
LIST = {"nargs": "+"}


def _names(flags: str) -> tuple[str, ...]:
    return tuple(flags.split())


def taken(flags: str, options: dict, why: str) -> EngineFlag:
    """A flag taken whatever its value; ``why`` says why that changes no output here."""
    names = _names(flags)
    return EngineFlag(names, options, _always, f"{names[0]}: {why}")


def taken_if(flags: str, options: dict, takes: Callable[[Any], bool], why: str, refusal: str) -> EngineFlag:
    """A flag taken when ``takes(value)`` (``why`` it then changes nothing), refused otherwise."""
    names = _names(flags)
    return EngineFlag(names, options, takes, f"{names[0]}: {why}", refusal)


def refused(flags: str, options: dict, refusal: str) -> EngineFlag:
    """A flag refused whatever its value; a switch is taken as ``--no-X`` (off, as loraplex runs)
    and a JSON object when it is empty."""
    takes = _off if options is BOOL else _empty if options is JSON else _never
    return EngineFlag(_names(flags), options, takes, "", refusal)
