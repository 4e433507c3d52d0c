"""``adapter_config.json``: parse, refuse what loraplex cannot serve exactly, and answer PEFT's
per-module questions (rank, alpha, scaling) with PEFT's own pattern rules."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

from loraplex.lora import config_patterns
from loraplex.lora.errors import InvalidAdapterError

# Config fields that switch on a feature loraplex does not implement: any truthy value is refused.
UNSUPPORTED_FEATURES = {
    "use_dora": "DoRA (use_dora)",
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "lora_bias": "lora_bias (a bias on lora_B)",
    "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable_token_indices",
    "alora_invocation_tokens": "aLoRA (alora_invocation_tokens)",
    "megatron_config": "megatron_config",
    "use_qalora": "QALoRA (use_qalora)",
    "arrow_config": "Arrow routing (arrow_config)",
    "use_bdlora": "use_bdlora",
    "kasa_config": "kasa_config",
    "velora_config": "velora_config",
    "monteclora_config": "monteclora_config",
}
MAX_PATTERN_CHARS = 1000


@dataclass(frozen=True)
class LoRAConfigView:
    """The math-relevant fields of a PEFT ``LoraConfig``, checked."""

    r: int
    lora_alpha: float
    target_modules: str | tuple[str, ...]  # regex string (full match) or names
    use_rslora: bool = False
    rank_pattern: tuple[tuple[str, int], ...] = ()  # file order matters: first match wins
    alpha_pattern: tuple[tuple[str, float], ...] = ()
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    exclude_modules: str | tuple[str, ...] | None = None
    fan_in_fan_out: bool = False
    # names (PEFT: exact, or a suffix after a dot) of raw parameters adapted, e.g.
    # "mlp.experts.gate_up_proj" (fused MoE experts); () = none
    target_parameters: tuple[str, ...] = ()
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    def canonical(self) -> dict:
        """The fields that change the math, in a canonical JSON-able form (for the hash)."""
        tm = self.target_modules if isinstance(self.target_modules, str) else sorted(self.target_modules)
        ex = self.exclude_modules
        extra = {"target_parameters": sorted(self.target_parameters)} if self.target_parameters else {}
        return extra | {
            "peft_type": "LORA",
            "r": self.r,
            "lora_alpha": _num(self.lora_alpha),
            "use_rslora": self.use_rslora,
            "rank_pattern": [[k, v] for k, v in self.rank_pattern],
            "alpha_pattern": [[k, _num(v)] for k, v in self.alpha_pattern],
            "target_modules": tm,
            "layers_to_transform": list(self.layers_to_transform) if self.layers_to_transform is not None else None,
            "layers_pattern": list(self.layers_pattern) if self.layers_pattern is not None else None,
            "exclude_modules": ex if ex is None or isinstance(ex, str) else sorted(ex),
            "fan_in_fan_out": self.fan_in_fan_out,
        }

    def layer_indexes(self) -> tuple[int, ...]:
        return self.layers_to_transform or ()

    def rank_alpha_for(self, module_key: str) -> tuple[int, float]:
        """PEFT's ``get_pattern_key``: the first pattern ``p`` (file order) with
        ``re.match(rf"(.*\\.)?({p})$", module_key)`` wins, else the global value."""
        rank = next((v for p, v in self.rank_pattern if _pattern_key_matches("rank_pattern", p, module_key)), self.r)
        alpha = next((v for p, v in self.alpha_pattern if _pattern_key_matches("alpha_pattern", p, module_key)),
                     self.lora_alpha)
        return rank, alpha

    def scaling(self, rank: int, alpha: float) -> float:
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank


def _num(v: float) -> int | float:
    return int(v) if float(v).is_integer() else float(v)


def _bad(msg: str) -> InvalidAdapterError:
    return InvalidAdapterError(f"adapter_config.json: {msg}")


def _pattern_key_regex(pattern: str) -> str:
    """What PEFT's ``get_pattern_key`` matches a module key against, for a ``rank_pattern`` /
    ``alpha_pattern`` key."""
    return rf"(.*\.)?({pattern})$"


def _pattern_key_matches(what: str, pattern: str, module_key: str) -> bool:
    return config_patterns.match(what, _pattern_key_regex(pattern), pattern, module_key) is not None


def _check_regex(what: str, pattern: str, built: str | None = None) -> None:
    """``pattern`` and, where given, the expression PEFT builds around it must compile."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise _bad(f"{what} pattern is longer than {MAX_PATTERN_CHARS} characters")
    config_patterns.check_compiles(what, pattern)
    if built is not None:
        config_patterns.check_compiles(what, built, shown=pattern)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _str_or_list(name: str, value: object, allow_none: bool) -> str | tuple[str, ...] | None:
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        if not value:
            raise _bad(f"{name} is an empty string")
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    if isinstance(value, list) and not value and allow_none:
        return None
    raise _bad(f"{name} must be a string or a non-empty list of strings, got {value!r}")


def parse_config(data: bytes) -> LoRAConfigView:
    """Parse and check ``adapter_config.json``; raises ``InvalidAdapterError`` naming the field."""
    try:
        cfg = json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as exc:
        # ValueError covers JSONDecodeError, UnicodeDecodeError and integers over Python's digit
        # limit; RecursionError is nesting deeper than the interpreter's recursion limit
        raise _bad(f"not valid JSON ({str(exc)[:200]})") from None
    if not isinstance(cfg, dict):
        raise _bad("not a JSON object")
    for required in ("peft_type", "r", "lora_alpha"):
        if cfg.get(required) is None:
            raise _bad(f"required field {required!r} is missing")
    # PEFT on transformers 5 adapts fused MoE experts as raw parameters (``target_parameters``,
    # its ``ParamWrapper``); such a config may name no module at all
    target_parameters = _str_or_list("target_parameters", cfg.get("target_parameters"), allow_none=True)
    if isinstance(target_parameters, str):  # PEFT takes a list of names only
        raise _bad(f"target_parameters must be a list of parameter names, got {target_parameters!r}")
    if cfg.get("target_modules") is None and not target_parameters:
        raise _bad("required field 'target_modules' is missing")
    if cfg["peft_type"] != "LORA":
        raise _bad(f"peft_type is {cfg['peft_type']!r}; only LORA adapters are served")
    for key, what in UNSUPPORTED_FEATURES.items():
        if cfg.get(key):
            raise _bad(f"{what} is not supported")
    bias = cfg.get("bias", "none")
    if bias != "none":
        raise _bad(f"bias={bias!r} is not supported (only 'none')")

    r = cfg["r"]
    if not _is_int(r) or r < 1:
        raise _bad(f"r must be a positive integer, got {r!r}")
    alpha = cfg["lora_alpha"]
    if not _is_num(alpha):
        raise _bad(f"lora_alpha must be a finite number, got {alpha!r}")
    use_rslora = cfg.get("use_rslora", False) or False
    fan_in_fan_out = cfg.get("fan_in_fan_out", False) or False
    if not isinstance(use_rslora, bool) or not isinstance(fan_in_fan_out, bool):
        raise _bad("use_rslora and fan_in_fan_out must be booleans")

    target_modules = ()
    if cfg.get("target_modules") is not None:
        target_modules = _str_or_list("target_modules", cfg["target_modules"], allow_none=bool(target_parameters)) or ()
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        target_modules = "all-linear"  # PEFT takes the shorthand in any case (_maybe_include_all_linear_layers)
    if isinstance(target_modules, str):
        _check_regex("target_modules", target_modules)
    exclude_modules = _str_or_list("exclude_modules", cfg.get("exclude_modules"), allow_none=True)
    if isinstance(exclude_modules, str):
        _check_regex("exclude_modules", exclude_modules)

    rank_pattern = _pattern_dict("rank_pattern", cfg.get("rank_pattern"), want_int=True)
    alpha_pattern = _pattern_dict("alpha_pattern", cfg.get("alpha_pattern"), want_int=False)

    ltt = cfg.get("layers_to_transform")
    if ltt is None or (isinstance(ltt, list) and not ltt):
        layers = None
    elif _is_int(ltt):
        layers = (ltt,)
    elif isinstance(ltt, list) and all(_is_int(v) for v in ltt):
        layers = tuple(sorted(set(ltt)))
    else:
        raise _bad(f"layers_to_transform must be an integer or a list of integers, got {ltt!r}")
    lp = cfg.get("layers_pattern")
    layers_pattern = _str_or_list("layers_pattern", lp, allow_none=True) if lp not in ("", None) else None
    if isinstance(layers_pattern, str):
        layers_pattern = (layers_pattern,)
    for p in layers_pattern or ():
        _check_regex("layers_pattern", p)

    return LoRAConfigView(
        r=r,
        lora_alpha=alpha,
        target_modules=target_modules,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        layers_to_transform=layers,
        layers_pattern=layers_pattern,
        exclude_modules=exclude_modules,
        fan_in_fan_out=fan_in_fan_out,
        target_parameters=target_parameters or (),
        raw=cfg,
    )


def _pattern_dict(name: str, value: object, want_int: bool) -> tuple:
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise _bad(f"{name} must be an object, got {value!r}")
    out = []
    for k, v in value.items():
        _check_regex(name, k, _pattern_key_regex(k))
        if want_int and (not _is_int(v) or v < 1):
            raise _bad(f"{name}[{k!r}] must be a positive integer, got {v!r}")
        if not want_int and not _is_num(v):
            raise _bad(f"{name}[{k!r}] must be a finite number, got {v!r}")
        out.append((k, v))
    return tuple(out)
