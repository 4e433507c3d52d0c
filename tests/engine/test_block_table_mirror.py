"""``BlockTableMirror`` against ``block_table_rows`` (block_table_reference.py: a fresh copy of every table)
over random histories of many sequences and several layer groups: tables growing, shrinking and
rewritten in place (with ``block_tables_version`` bumped, as the block manager does), replaced
by new lists (free, preempt, resume), sequences released or never released, rows reused, the
host array outgrowing its first size in rows and columns."""

from __future__ import annotations

import random

import numpy as np
import pytest

from loraplex.engine.block_table_mirror import BlockTableMirror
from tests.engine.block_table_reference import block_table_rows
from loraplex.engine.outputs import ScheduledSeq
from loraplex.engine.sequence import Sequence
from loraplex.sampling_params import SamplingParams


def _reference(scheduled, lengths, first_blocks, group: int) -> np.ndarray:
    tables = [item.block_tables[group] for item in scheduled]
    block_size = 4
    seq_lens = [n * block_size for n in lengths]
    firsts = None if first_blocks[group] is None else list(first_blocks[group])
    return block_table_rows(tables, seq_lens, block_size, first_blocks=firsts)


@pytest.mark.parametrize("seed", range(8))
def test_mirror_gives_what_a_fresh_copy_gives(seed):
    rng = random.Random(seed)
    num_groups = rng.choice([1, 2, 3])
    mirror = BlockTableMirror(num_groups, rows=rng.choice([1, 4]), width=rng.choice([1, 4]))
    seqs = [Sequence(i, str(i), [1], SamplingParams()) for i in range(rng.randint(5, 40))]
    for seq in seqs:
        seq.block_tables = [[] for _ in range(num_groups)]
    next_page = iter(range(10**6))
    checked = 0
    for _ in range(120):
        for seq in seqs:
            op = rng.random()
            tables = seq.block_tables
            if op < 0.5:  # grow (a decode crossing into a new block, a prompt chunk)
                for _ in range(rng.choice([0, 0, 1, 1, 3])):
                    for table in tables:
                        table.append(next(next_page))
            elif op < 0.6 and tables[0]:  # pop blocks in place (rejected drafts), maybe regrow
                k = rng.randint(1, len(tables[0]))
                refill = rng.randint(0, k)
                for table in tables:
                    del table[-k:]
                    table.extend(next(next_page) for _ in range(refill))
                seq.block_tables_version += 1
            elif op < 0.7 and tables[0]:  # rewrite entries in place (a window's head given back)
                i = rng.randrange(len(tables[0]))
                for table in tables:
                    table[i] = rng.choice([-1, next(next_page)])
                seq.block_tables_version += 1
            elif op < 0.75:  # freed and allocated again: new lists
                k = rng.randint(0, 5)
                seq.block_tables = [[next(next_page) for _ in range(k)] for _ in range(num_groups)]
            elif op < 0.78:  # released (the runner's hook); its id may come back
                mirror.forget([seq.seq_id])
        step = [seq for seq in seqs if seq.block_tables[0] and rng.random() < 0.7]
        if not step:
            continue
        rng.shuffle(step)
        scheduled = [ScheduledSeq(seq, 0, 1, seq.block_tables[0], True, None, block_tables=seq.block_tables)
                     for seq in step]
        lengths = [rng.randint(1, len(seq.block_tables[0])) for seq in step]  # tables may hold more
        first_blocks = [None if rng.random() < 0.5 else np.array([rng.randint(0, n + 1) for n in lengths])
                        for _ in range(num_groups)]
        got = mirror.gather(mirror.sync(scheduled), np.array(lengths), first_blocks)
        for g in range(num_groups):
            want = _reference(scheduled, lengths, first_blocks, g)
            assert got[g].dtype == np.int32 and np.array_equal(got[g], want), (g, got[g], want)
        checked += 1
        # what sync reads entry by entry: the same values as the lists
        rows = mirror.sync(scheduled)
        blocks = np.array([rng.randrange(n) for n in lengths])
        for g in range(num_groups):
            assert mirror.entries(g, rows, blocks).tolist() == [
                item.block_tables[g][b] for item, b in zip(scheduled, blocks)]
    assert checked > 100
    # rows of sequences never released are reclaimed once the array holds twice a step's need
    assert mirror.num_rows_held <= max(2 * len(seqs), 16)


def test_an_in_place_change_without_a_version_bump_is_not_seen():
    """Why the block manager bumps ``block_tables_version``: appends are found by length alone,
    rewrites are not (this pins the contract the mirror relies on)."""
    mirror = BlockTableMirror(1)
    seq = Sequence(0, "0", [1], SamplingParams())
    seq.block_tables = [[5, 6]]
    item = ScheduledSeq(seq, 0, 1, seq.block_tables[0], True, None, block_tables=seq.block_tables)
    assert mirror.gather(mirror.sync([item]), np.array([2]))[0].tolist() == [[5, 6]]
    seq.block_tables[0][1] = 9
    assert mirror.gather(mirror.sync([item]), np.array([2]))[0].tolist() == [[5, 6]]
    seq.block_tables_version += 1
    assert mirror.gather(mirror.sync([item]), np.array([2]))[0].tolist() == [[5, 9]]
    seq.block_tables[0].append(7)
    assert mirror.gather(mirror.sync([item]), np.array([3]))[0].tolist() == [[5, 9, 7]]


def test_tables_of_another_layout_are_refused():
    mirror = BlockTableMirror(2)
    seq = Sequence(0, "0", [1], SamplingParams())
    seq.block_tables = [[1]]
    with pytest.raises(ValueError, match="1 block tables per sequence for 2 layer groups"):
        mirror.sync([ScheduledSeq(seq, 0, 1, [1], True, None, block_tables=seq.block_tables)])
