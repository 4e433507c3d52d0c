"""``loraplex usage``: what tenants used, per tenant, adapter, hour or day, read from the registry
database directly (no server needed; the one ``Settings`` names, like ``loraplex tenants``).

Servers write their sums every ``usage_flush_seconds``, so the last few seconds of a running
server may not be in it yet. ``--json`` prints what ``GET /admin/v1/usage`` answers.
"""

from __future__ import annotations

import argparse

from loraplex.config import Settings
from loraplex.registry.cli import _print_json, _registry, _run
from loraplex.registry.usage import GROUP_KEYS, parse_hour

COLUMNS = ("requests", "prompt_tokens", "completion_tokens", "total_tokens", "failed_requests")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("usage", help="requests and tokens per tenant, adapter, hour or day (for billing)")
    p.add_argument("--tenant", help="only this tenant")
    p.add_argument("--adapter", help="only this adapter name")
    p.add_argument("--start", metavar="TIME", help="from this hour, inclusive (ISO 8601, UTC without an offset)")
    p.add_argument("--end", metavar="TIME", help="up to this hour, exclusive (ISO 8601)")
    p.add_argument("--group-by", action="append", default=[], metavar="KEYS",
                   help=f"comma-separated, repeatable: {', '.join(GROUP_KEYS)} (hour or day, not both)")
    p.add_argument("--json", action="store_true", help="print JSON (the admin API's answer)")
    p.set_defaults(func=_usage)


@_run
def _usage(args: argparse.Namespace, settings: Settings) -> int:
    report = _registry(settings).usage_report(
        tenant=args.tenant,
        adapter=args.adapter,
        start=None if args.start is None else parse_hour(args.start, "--start"),
        end=None if args.end is None else parse_hour(args.end, "--end"),
        group_by=args.group_by,
    )
    if args.json:
        _print_json(report.to_dict())
        return 0
    keys = list(report.group_by)
    table = [keys + list(COLUMNS)]
    for row in report.rows:
        table.append([_cell(row[k], k) for k in keys] + [str(row[c]) for c in COLUMNS])
    table.append(["total"] + [""] * max(0, len(keys) - 1) + [str(report.totals[c]) for c in COLUMNS])
    if not keys:
        table[-1] = table[-1][1:]  # one row and no keys: the total is the row
        del table[1:-1]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    for line in table:
        print("  ".join(cell.ljust(w) if i < len(keys) else cell.rjust(w)
                        for i, (cell, w) in enumerate(zip(line, widths))).rstrip())
    return 0


def _cell(value, key: str) -> str:
    if key == "adapter" and value is None:
        return "(base model)"
    return str(value)
