"""Qwen2 / Qwen3 sliding windows: which layers attend within ``sliding_window``, as transformers
derives it (``Qwen2Config`` / ``Qwen3Config.__post_init__``).

With ``use_sliding_window: true`` the window is ``sliding_window`` (transformers' default 4096
when the key is left out; an explicit null means none); without the flag there is no window
whatever ``sliding_window`` says (published Qwen2.5 configs carry ``sliding_window: 131072``
with the flag off). ``layer_types`` decides per layer when given; otherwise layers
``max_window_layers`` (default 28) and up slide, the ones below attend to the whole context. A
``layer_types`` naming a sliding layer without a window is refused: transformers raises on it
when it builds the mask.
"""

from __future__ import annotations

from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"
QWEN_ARCHITECTURES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
DEFAULT_SLIDING_WINDOW = 4096  # transformers' Qwen2Config / Qwen3Config default
DEFAULT_MAX_WINDOW_LAYERS = 28


def qwen_layer_windows(cfg: dict[str, Any], arch: str, num_layers: int) -> tuple[int | None, ...]:
    """Per layer, the window it attends within (None: the whole context). Raises ``ValueError``
    (with the reason) for what transformers itself would not run."""
    window = cfg.get("sliding_window", DEFAULT_SLIDING_WINDOW) if cfg.get("use_sliding_window") else None
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{arch}: sliding_window must be a positive integer or null, got {window!r}")
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", DEFAULT_MAX_WINDOW_LAYERS)
        if isinstance(first, bool) or not isinstance(first, int):
            raise ValueError(f"{arch}: max_window_layers must be an integer, got {first!r}")
        types = [SLIDING if window is not None and i >= first else FULL for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers or not set(types) <= {SLIDING, FULL}:
        raise ValueError(f"{arch}: layer_types must name {SLIDING!r} or {FULL!r} for each of the {num_layers} layers")
    if window is None and SLIDING in types:
        raise ValueError(
            f"{arch}: layer_types names sliding layers but there is no window "
            "(use_sliding_window is false or sliding_window is null); transformers refuses this config too"
        )
    return tuple(window if t == SLIDING else None for t in types)
