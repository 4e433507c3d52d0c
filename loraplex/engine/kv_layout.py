"""How the layers of a model share the paged KV pool: layer groups. Pure Python, no torch.

A model whose layers attend differently (Gemma 2: every other layer windowed; Gemma 3: five of
six) keeps, per sequence, a whole context of KV for its global layers but only a window's for the
windowed ones. The layers are split into groups of ``group_size`` layers each, every group all
global or all windowed with one window (the last group of a kind padded with unused positions).
The cache has ``group_size`` storage tensors ("layer slots"), each
``[2, num_pages, block_size, num_kv_heads, head_dim]``; layer ``l`` stores its KV in tensor
``layer_slot[l]`` at the pages of its group's block table (``layer_group[l]``). A page thus holds
one block of tokens for the ``group_size`` layers of whichever group took it, and the pool is one
free list shared by all groups, so memory moves between global and windowed layers as the load
needs (vLLM v1's hybrid KV cache manager makes the same trade).

Each sequence has one block table per group; a windowed group's table gives back the pages
before its window (``block_manager.FREED_BLOCK`` entries), a global group's grows with the
context. A model without windows is one global group of all its layers; a model whose layers
all share a window is one windowed group: both have today's page = one block of every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

# the padded layer positions a grouping may waste, as a fraction of the model's layers: a padded
# position costs its share of every page of its group, so it is spent only where smaller groups
# (more tables per sequence, more Python per step) would be the dearer choice
MAX_PADDING_FRACTION = 0.1


@dataclass(frozen=True)
class KVLayout:
    """Layer groups over one page pool (see module doc)."""

    group_windows: tuple[int | None, ...]  # per group: its layers' window, None = global attention
    layer_group: tuple[int, ...]  # per layer: its group
    layer_slot: tuple[int, ...]  # per layer: its storage tensor (its position in its group)
    group_size: int  # layers per group = storage tensors = layer-blocks per page

    @classmethod
    def single(cls, num_layers: int, window: int | None = None) -> "KVLayout":
        """Every layer in one group (no windows, or the same window on every layer)."""
        return cls((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)

    @classmethod
    def from_layer_windows(cls, windows: list[int | None] | tuple[int | None, ...]) -> "KVLayout":
        """Group the layers of a model whose layer ``l`` attends within ``windows[l]`` (None: all
        of the context)."""
        if not windows:
            raise ValueError("a model has at least one layer")
        if any(w is not None and w < 1 for w in windows):
            raise ValueError("a sliding window is at least 1")
        kinds = sorted(set(windows), key=lambda w: (w is not None, w or 0))  # global groups first
        layers_of = {kind: [l for l, w in enumerate(windows) if w == kind] for kind in kinds}
        size = _group_size([len(v) for v in layers_of.values()], len(windows))
        group_windows: list[int | None] = []
        layer_group = [0] * len(windows)
        layer_slot = [0] * len(windows)
        for kind in kinds:
            for j, layer in enumerate(layers_of[kind]):
                if j % size == 0:
                    group_windows.append(kind)
                layer_group[layer] = len(group_windows) - 1
                layer_slot[layer] = j % size
        return cls(tuple(group_windows), tuple(layer_group), tuple(layer_slot), size)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    @property
    def uniform_window(self) -> int | None:
        """The window when every group has the same one, else None."""
        first = self.group_windows[0]
        return first if all(w == first for w in self.group_windows) else None

    def peak_pages_per_sequence(self, max_model_len: int, block_size: int, max_chunk_tokens: int | None) -> int:
        """The most pages one sequence of up to ``max_model_len`` tokens holds at once: its
        whole context in every global group, and in every windowed group, when prompts are
        computed in chunks of at most ``max_chunk_tokens``, the window's blocks plus the chunk's
        (a span of ``window - 1 + chunk`` positions, over one block more when it does not start at
        a block's first slot). Without chunks a prompt is computed whole."""
        whole = -(-max_model_len // block_size)
        total = 0
        for window in self.group_windows:
            if window is None or max_chunk_tokens is None:
                total += whole
            else:
                total += min(whole, -(-(window - 1 + max_chunk_tokens) // block_size) + 1)
        return total

    def longest_context_within(self, num_pages: int, max_model_len: int, block_size: int,
                               max_chunk_tokens: int | None) -> int:
        """The longest context (at most ``max_model_len``) whose peak fits ``num_pages``; 0 when
        not even one token does."""
        lo, hi = 0, max_model_len  # peak_pages_per_sequence grows with the length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_pages_per_sequence(mid, block_size, max_chunk_tokens) <= num_pages:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _group_size(counts: list[int], num_layers: int) -> int:
    """The largest group size (at most the smallest kind's layer count) whose padding stays
    within ``MAX_PADDING_FRACTION`` of the layers; 1 never pads."""
    budget = int(num_layers * MAX_PADDING_FRACTION)
    for size in range(min(counts), 0, -1):
        if sum(-(-n // size) * size - n for n in counts) <= budget:
            return size
    return 1
