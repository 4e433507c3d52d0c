"""The host inputs of a step in which every sequence runs one token (decodes), built once for
either forward: the eager one (``ModelRunner.prepare_batch``) and the CUDA-graph replay
(``cuda_graphs.DecodeGraphs``, which pads them to its bucket). At large batches this is most
steps, and its per-sequence Python is a share of the host time a GPU waits for.

The general path (``prepare_batch`` for steps with prompt chunks or drafts) gives the same
arrays for such a step; tests/engine/test_decode_inputs.py holds the two together.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from loraplex.engine.block_table_mirror import BlockTableMirror
from loraplex.engine.outputs import ScheduledSeq


@dataclass
class DecodeInputs:
    """One token per sequence, in ``scheduled`` order."""

    input_ids: np.ndarray  # [num_seqs] int64
    positions: np.ndarray  # [num_seqs] int64
    slot_mappings: list[np.ndarray]  # per layer group: [num_seqs] int64 KV slot of each token
    seq_lens: np.ndarray  # [num_seqs] int32, positions + 1
    block_tables: list[np.ndarray]  # per layer group: [num_seqs, max blocks] int32
    # rows whose token the step before is still sampling (``pending_ok``): zeros in input_ids
    pending_rows: list[int] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.input_ids)


def window_first_blocks(starts: np.ndarray, window: int | None, block_size: int) -> np.ndarray | None:
    """Per sequence whose step's queries start at ``starts[i]`` ([num_seqs] int64), the first
    block a layer with ``window`` reads (the block manager has given back the ones before it);
    None without a window."""
    if window is None:
        return None
    return np.maximum(starts - window + 1, 0) // block_size


def is_one_token_step(scheduled: list[ScheduledSeq]) -> bool:
    """Every sequence runs one known token: no draft tokens, no prompt logprobs to compute."""
    for item in scheduled:
        if item.num_tokens != 1 or item.draft_token_ids:
            return False
        if item.seq.params.prompt_logprobs is not None and item.seq.needs_prompt_logprobs:
            return False
    return True


def decode_inputs(scheduled: list[ScheduledSeq], block_size: int, group_windows: tuple[int | None, ...],
                  mirror: BlockTableMirror, pending_ok: bool = False) -> DecodeInputs:
    """The inputs of a step for which ``is_one_token_step`` holds. The slots and block tables
    come from ``mirror``'s rows with numpy, not from the table lists one sequence at a time.
    ``pending_ok``: a step scheduled ahead, where a token the host does not have yet is one the
    step before is still sampling (listed in ``pending_rows``; the caller puts those in): 0 here."""
    input_ids: list[int] = []
    pending: list[int] = []
    for row, item in enumerate(scheduled):
        seq, pos = item.seq, item.start_pos
        out_index = pos - len(seq.prompt_token_ids)  # seq.token_at(pos), without the call
        if out_index < 0:
            input_ids.append(seq.prompt_token_ids[pos])
        elif pending_ok and out_index == len(seq.output_token_ids):
            pending.append(row)
            input_ids.append(0)
        else:
            input_ids.append(seq.output_token_ids[out_index])
    positions = [item.start_pos for item in scheduled]
    rows = mirror.sync(scheduled)
    pos = np.array(positions, dtype=np.int64)
    blocks, offsets = np.divmod(pos, block_size)
    slot_mappings = [mirror.entries(g, rows, blocks) * block_size + offsets for g in range(len(group_windows))]
    first_blocks = [window_first_blocks(pos, window, block_size) for window in group_windows]
    tables = mirror.gather(rows, blocks + 1, first_blocks)
    return DecodeInputs(np.array(input_ids, dtype=np.int64), pos, slot_mappings, (pos + 1).astype(np.int32), tables,
                        pending)
