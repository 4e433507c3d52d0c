"""The block tables of a step as int32 arrays, kept as host copies that are updated in place.

A step's attention reads ``[num_seqs, width]`` block tables per layer group. Built from the
sequences' Python lists every step, the copy grows with the context: 256 sequences of 1,000
tokens in 16-token blocks are 16,000 list entries converted per step (about 0.7 ms on the CI VM,
4 ms at 8,000 tokens). Yet a decoding sequence's table gains one entry every ``block_size``
steps and otherwise stays as it was, so ``BlockTableMirror`` keeps one row per sequence in a
host array per group, copies only the entries added since the last step, and gathers the
step's rows with one numpy index.

When a row is copied again whole: the sequence's tables are other list objects than last time
(the block manager replaces them when a sequence is freed, preempted or allocated), or
``seq.block_tables_version`` moved (the block manager bumps it whenever it changes or removes
entries in place: a windowed group's entries set to ``FREED_BLOCK``, a speculative step's
blocks popped). Appending is the only in-place change that needs no bump. Rows of sequences
the runner releases go back to a free list; rows of sequences never released (none should be)
are dropped once the array would otherwise grow past twice what the steps use.

The result equals a fresh copy of every table (tests/engine/test_block_table_mirror.py).
"""

from __future__ import annotations

import numpy as np

from loraplex.engine.outputs import ScheduledSeq


class _Row:
    """A sequence's row: where it is, the table lists it mirrors, how much of each is copied."""

    __slots__ = ("index", "tables", "first_table", "length", "version", "copied")

    def __init__(self, index: int, num_groups: int, version: int):
        self.index = index
        self.tables: list = [None] * num_groups  # the per-group lists themselves (identity is checked)
        self.first_table = None  # tables[0], read by the fast check
        self.length = -1  # len(tables[0]) when last synced
        self.version = version
        self.copied = [0] * num_groups  # per group: entries copied so far


class BlockTableMirror:
    """Host copies of running sequences' block tables, one array per layer group (module doc)."""

    def __init__(self, num_groups: int, rows: int = 64, width: int = 16):
        self.num_groups = num_groups
        self._arrays = [np.zeros((max(rows, 1), width), dtype=np.int32) for _ in range(num_groups)]  # [rows, width]
        self._rows: dict[int, _Row] = {}  # seq_id -> its row
        self._free = list(range(max(rows, 1) - 1, -1, -1))
        self._most_rows_used = 0  # the most rows one step has asked for

    @property
    def num_rows_held(self) -> int:
        return len(self._rows)

    def forget(self, seq_ids) -> None:
        """The sequences' rows go back to the free list (released, preempted or finished)."""
        rows, free = self._rows, self._free
        for seq_id in seq_ids:
            row = rows.pop(seq_id, None)
            if row is not None:
                free.append(row.index)

    def sync(self, scheduled: list[ScheduledSeq]) -> np.ndarray:  # [num_seqs] int64 row indices
        """Bring the rows of ``scheduled``'s sequences up to date; returns their indices in order.
        The block manager keeps a sequence's tables all the same length, so an unchanged first
        table (same list, same length, same ``block_tables_version``) means nothing to copy."""
        rows = self._rows
        indices = []
        append = indices.append
        if len(scheduled) > self._most_rows_used:
            self._most_rows_used = len(scheduled)
        for item in scheduled:
            seq = item.seq
            tables = item.block_tables
            row = rows.get(seq.seq_id)
            if (row is not None and row.first_table is tables[0] and row.length == len(tables[0])
                    and row.version == seq.block_tables_version):
                append(row.index)
            else:
                append(self._update(seq, tables, row, scheduled))
        return np.array(indices, dtype=np.int64)

    def _update(self, seq, tables: list[list[int]], row: _Row | None, scheduled: list[ScheduledSeq]) -> int:
        """Copy what changed of ``seq``'s tables into its row (a new row when it has none, or
        when its tables were replaced or changed in place); returns the row's index."""
        version = seq.block_tables_version
        if row is None or row.version != version or len(row.tables) != len(tables):
            row = self._new_row(seq.seq_id, len(tables), version, scheduled)
        index, copied, mirrored = row.index, row.copied, row.tables
        for g, table in enumerate(tables):
            done, n = copied[g], len(table)
            array = self._arrays[g]
            if table is not mirrored[g] or n < done:  # another list, or shrunk without a bump
                array[index] = 0
                mirrored[g] = table
                done = 0
            if n != done:
                if n > array.shape[1]:
                    self._widen(n)
                    array = self._arrays[g]
                array[index, done:n] = table[done:n]
                copied[g] = n
        row.first_table, row.length = tables[0], len(tables[0])
        return index

    def entries(self, group: int, indices: np.ndarray, blocks: np.ndarray) -> np.ndarray:
        """``table[blocks[i]]`` of row ``indices[i]`` in ``group`` (rows synced this step)."""
        return self._arrays[group][indices, blocks]

    def gather(self, indices: np.ndarray, lengths: np.ndarray,
               first_blocks: list[np.ndarray | None] | None = None) -> list[np.ndarray]:
        """Per group, ``[len(indices), max(lengths)]`` int32: row ``i`` holds its first
        ``lengths[i]`` entries, then 0; entries before ``first_blocks[g][i]`` are -1 (a windowed
        group's head, which no kernel reads). As a fresh copy of the tables would."""
        lengths = np.asarray(lengths, dtype=np.int64)
        width = int(lengths.max())
        if width > self._arrays[0].shape[1]:  # only when a table is shorter than its length
            raise ValueError(f"a block table has fewer than the {width} entries its sequence length needs")
        cols = np.arange(width)
        past_end = cols >= lengths[:, None]  # [num_seqs, width]; rows hold 0 past their table already,
        trim = bool(past_end.any())  # but a table may hold more blocks than its length uses
        out = []
        for g, array in enumerate(self._arrays):
            rows = array[indices, :width]  # a copy (fancy index)
            if trim:
                rows[past_end] = 0
            firsts = None if first_blocks is None else first_blocks[g]
            if firsts is not None:
                firsts = np.minimum(np.asarray(firsts, dtype=np.int64), lengths)
                if firsts.any():
                    rows[cols < firsts[:, None]] = -1
            out.append(rows)
        return out

    def _new_row(self, seq_id: int, num_groups: int, version: int, scheduled: list[ScheduledSeq]) -> _Row:
        """A row mirroring nothing yet (``_update`` zeroes it as it copies each group's table)."""
        if num_groups != self.num_groups:
            raise ValueError(f"{num_groups} block tables per sequence for {self.num_groups} layer groups")
        old = self._rows.pop(seq_id, None)
        if old is not None:
            index = old.index
        else:
            if not self._free:
                self._make_room(scheduled)
            index = self._free.pop()
        row = self._rows[seq_id] = _Row(index, num_groups, version)
        return row

    def _make_room(self, scheduled: list[ScheduledSeq]) -> None:
        """No free row: drop rows of sequences this step does not run when the array already has
        twice the rows a step has used (their sequences were never released), else grow it."""
        capacity = self._arrays[0].shape[0]
        if capacity >= 2 * self._most_rows_used:
            live = {item.seq.seq_id for item in scheduled}
            self.forget([seq_id for seq_id in self._rows if seq_id not in live])
            if self._free:
                return
        grow = max(capacity, 16)
        self._arrays = [np.concatenate([a, np.zeros((grow, a.shape[1]), dtype=np.int32)]) for a in self._arrays]
        self._free.extend(range(capacity + grow - 1, capacity - 1, -1))

    def _widen(self, width: int) -> None:
        new_width = max(width, 2 * self._arrays[0].shape[1])
        self._arrays = [np.pad(a, ((0, 0), (0, new_width - a.shape[1]))) for a in self._arrays]
