"""``loraplex run-batch``: vLLM's ``python -m vllm.entrypoints.openai.run_batch``, on OpenAI's Batch
file format (loraplex/server/batch_file.py). Example::

    loraplex run-batch -i requests.jsonl -o results.jsonl --model ./my-model \\
        --lora-modules sql=./adapters/sql support=./adapters/support

Each line is answered as ``loraplex serve`` answers a POST of its body (without HTTP: the server's
own admission and answer code, on an engine in this process), lines concurrently so the engine
batches them. ``model`` names the base model or an adapter: one of ``--lora-modules`` (PEFT
directories, for this run only) or, with ``--tenant T``, one of T's adapters in the registry
(``LORAPLEX_HOME``, ``LORAPLEX_DATABASE_URL``). Engine flags are ``loraplex serve``'s.
``-i -`` reads stdin, ``-o -`` writes stdout; a file output appears whole, once every line is
answered. Progress goes to stderr. The exit status is 0 once the file is processed, failed lines
included (their status and error are in the output); 2 when the flags, input or output are
unusable, 1 when the model or the engine fails, 130 when SIGINT or SIGTERM stops it (no output
file then, and no partial file left beside it).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import signal
import stat
import sys
import tempfile
from pathlib import Path

from loraplex.server import http_options, vllm_engine_flags, vllm_flags
from loraplex.server.cli import add_settings_flags, settings_or_error

log = logging.getLogger(__name__)

# Settings that mean nothing without an HTTP server (or that a batch sets itself)
SKIPPED_SETTINGS = frozenset({
    "host", "port", "registry_poll_seconds", "blob_gc_interval_seconds", "blob_gc_min_age_seconds", "max_body_bytes",
    "max_concurrent_requests_per_tenant", "shutdown_grace_seconds", "max_upload_member_bytes",
    "tenant_limits_scope",  # a batch is one process, and applies no tenant's limits
    "usage_flush_seconds",  # a batch run records no usage: its output file has every line's usage
}) | http_options.SERVER_ONLY_FIELDS
DEFAULT_MAX_CONCURRENCY = 256
BATCH_TENANT = "batch"  # the tenant lines run as without --tenant (metrics and prefix-cache scope only)
USAGE_ERROR, RUN_FAILED = 2, 1
INTERRUPTED = 130  # a shell's status for a run stopped by Ctrl-C (SIGTERM is taken as one)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "run-batch",
        help="answer an OpenAI batch file (JSONL) offline, as vLLM's run_batch",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-i", "--input-file", required=True, help="the batch file (JSON lines), or - for stdin")
    p.add_argument("-o", "--output-file", required=True, help="where the results go (JSON lines), or - for stdout")
    p.add_argument("--max-concurrency", type=int, default=DEFAULT_MAX_CONCURRENCY,
                   help=f"lines in flight at once (default {DEFAULT_MAX_CONCURRENCY})")
    p.add_argument("--lora-modules", nargs="+", action="extend", default=[], metavar="NAME=PATH",
                   help='PEFT adapter directories `model` may name, for this run only: name=path or '
                        'JSON {"name": ..., "path": ...} (vLLM\'s forms)')
    p.add_argument("--tenant", default=None,
                   help="also resolve `model` to this tenant's adapters in the loraplex registry")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_settings_flags(p, SKIPPED_SETTINGS)
    vllm_flags.add_vllm_flags(p, taken=frozenset({"lora_modules", "api_key"}), command="run-batch")
    p.set_defaults(func=run_batch_command)


def _fail(message: str, code: int) -> int:
    print(f"loraplex run-batch: error: {message}", file=sys.stderr)
    return code


def read_input(name: str) -> bytes:
    """The batch file's bytes (OSError when it cannot be read)."""
    return sys.stdin.buffer.read() if name == "-" else Path(name).read_bytes()


class BatchOutput:
    """Result lines to stdout (``-``), or to a file that appears whole: written to a hidden file
    beside it, renamed over it by ``commit``, removed by ``discard``. Opening fails (OSError) at
    once when the place is not writable, before any model is loaded."""

    def __init__(self, name: str):
        self.target = None if name == "-" else Path(name)
        if self.target is None:
            self.stream, self._temp = sys.stdout, None
        else:
            if self.target.is_dir():  # the rename at the end would fail, after every line ran
                raise IsADirectoryError(errno.EISDIR, "is a directory", str(self.target))
            fd, temp = tempfile.mkstemp(prefix=f".{self.target.name}.", suffix=".partial", dir=self.target.parent)
            self.stream, self._temp = os.fdopen(fd, "w", encoding="utf-8"), temp
            # mkstemp's file is 0600; the results get the mode open(path, "w") would leave
            # (vLLM's): an existing target's, else 0666 less the umask
            os.chmod(fd, _target_mode(self.target))

    def write(self, line: str) -> None:
        self.stream.write(line)

    def commit(self) -> None:
        self.stream.flush()
        if self._temp is not None:
            self.stream.close()
            os.replace(self._temp, self.target)
            self._temp = None

    def discard(self) -> None:
        if self._temp is not None:
            self.stream.close()
            os.unlink(self._temp)
            self._temp = None


def _target_mode(target: Path) -> int:
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        umask = os.umask(0)  # read by setting it; restored at once (the CLI runs no threads yet)
        os.umask(umask)
        return 0o666 & ~umask


def run_batch_command(args: argparse.Namespace) -> int:
    from loraplex.server.batch_adapters import parse_lora_module
    from loraplex.server.batch_file import parse_lines

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_concurrency < 1:
        return _fail("--max-concurrency must be at least 1", USAGE_ERROR)
    try:
        modules = [parse_lora_module(text) for text in args.lora_modules]
    except ValueError as exc:
        return _fail(str(exc), USAGE_ERROR)
    settings = settings_or_error(args, "run-batch", max_concurrent_requests_per_tenant=args.max_concurrency)
    if settings is None:
        return USAGE_ERROR
    for note in vllm_engine_flags.notes(args):
        log.info("vLLM flag taken: %s", note)
    try:
        items = parse_lines(read_input(args.input_file))
    except OSError as exc:
        return _fail(f"cannot read the input file: {exc}", USAGE_ERROR)
    try:
        output = BatchOutput(args.output_file)
    except OSError as exc:
        return _fail(f"cannot write the output file {args.output_file}: {exc}", USAGE_ERROR)
    code = RUN_FAILED
    # SIGTERM as Ctrl-C: the run stops, and its partial output goes (it was left beside the target)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = _run(settings, args.tenant, modules, items, output, args.max_concurrency)
    except KeyboardInterrupt:
        code = _fail("stopped by a signal; no output written", INTERRUPTED)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if code == 0:
            output.commit()
        else:
            output.discard()
    return code


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _run(settings, tenant: str | None, modules, items, output: BatchOutput, max_concurrency: int) -> int:
    from loraplex.server.batch_setup import SetupError, build_batch_context, close_batch_context
    from loraplex.server.batch_file import dump_line
    from loraplex.server.batch_runner import Progress, run_lines

    try:
        ctx = build_batch_context(settings, modules, tenant)
    except SetupError as exc:
        return _fail(str(exc), exc.exit_code)
    try:
        progress = Progress(len(items))
        summary = asyncio.run(run_lines(ctx, tenant or BATCH_TENANT, items, lambda r: output.write(dump_line(r)),
                                        max_concurrency, progress))
        if not ctx.engine.is_running:
            return _fail("the engine stopped during the run (see the log above)", RUN_FAILED)
    finally:
        close_batch_context(ctx)
    rate = summary.completion_tokens / summary.seconds if summary.seconds else 0.0
    print(f"loraplex run-batch: {summary.lines} lines in {summary.seconds:.2f} s: {summary.succeeded} succeeded, "
          f"{summary.failed} failed {summary.statuses}; {summary.prompt_tokens} prompt and "
          f"{summary.completion_tokens} completion tokens ({rate:.1f} completion tokens/s)", file=sys.stderr)
    return 0
