"""``loraplex serve --gc-debug``: the garbage-collection pause log."""

from __future__ import annotations

import gc
import logging
import re

from loraplex.cli import build_parser
from loraplex.server.cli import GcPauseLog


def test_gc_debug_is_an_opt_in_serve_flag():
    parser = build_parser()
    assert parser.parse_args(["serve", "--gc-debug"]).gc_debug is True
    assert parser.parse_args(["serve"]).gc_debug is False


def _collect_with_probe(logger: logging.Logger, generation: int) -> int:
    probe = GcPauseLog(logger)
    gc.collect()  # nothing left over for the collection under test
    a, b = [], []
    a.append(b)
    b.append(a)  # a cycle only the collector can free
    del a, b
    gc.callbacks.append(probe)
    try:
        return gc.collect(generation)
    finally:
        gc.callbacks.remove(probe)


def test_a_full_collection_is_logged_with_what_gc_says_it_freed(caplog):
    logger = logging.getLogger("test.gc_debug")
    with caplog.at_level(logging.INFO, logger="test.gc_debug"):
        freed = _collect_with_probe(logger, 2)
    assert freed >= 2  # the stdlib's own count: at least the two lists of the cycle
    (record,) = [r for r in caplog.records if r.name == "test.gc_debug"]
    match = re.fullmatch(r"gc: generation 2 collection in thread (\S+) paused it ([0-9.]+) ms, collected (\d+) "
                         r"\(uncollectable 0\), (\d+) objects frozen", record.getMessage())
    assert match, record.getMessage()
    assert match[1] == "MainThread"
    assert 0 <= float(match[2]) < 10_000
    assert int(match[3]) == freed
    assert int(match[4]) == gc.get_freeze_count()


def test_young_collections_are_logged_only_at_debug(caplog):
    logger = logging.getLogger("test.gc_debug_young")
    with caplog.at_level(logging.INFO, logger="test.gc_debug_young"):
        _collect_with_probe(logger, 0)
    assert not [r for r in caplog.records if r.name == "test.gc_debug_young"]
    with caplog.at_level(logging.DEBUG, logger="test.gc_debug_young"):
        freed = _collect_with_probe(logger, 0)
    (record,) = [r for r in caplog.records if r.name == "test.gc_debug_young"]
    assert record.levelno == logging.DEBUG
    assert record.getMessage().startswith("gc: generation 0 collection")
    assert f"collected {freed} " in record.getMessage()
