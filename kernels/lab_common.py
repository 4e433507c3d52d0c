"""Shared pieces of the kernel lab: batch metadata, timing, the report.

Not part of the loraplex package; imported by the lab scripts beside it (``gpu_check.py``).
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from pathlib import Path

import torch

from loraplex.kernels.lora_meta import LoRABatchMeta


def make_meta(token_slots: list[int], slot_rank: list[int], device: str) -> LoRABatchMeta:
    """Metadata for a flat batch whose token ``t`` uses slot ``token_slots[t]`` (-1 = base):
    tokens stably sorted by slot, one segment per distinct slot (the runner's layout)."""
    slots = torch.tensor(token_slots, dtype=torch.int64)
    perm = torch.sort(slots, stable=True).indices
    ordered = slots[perm].tolist()
    seg_starts, seg_slot = [0], []
    for i, slot in enumerate(ordered):
        if i == 0 or slot != ordered[i - 1]:
            if i > 0:
                seg_starts.append(i)
            seg_slot.append(slot)
    seg_starts.append(len(ordered))
    present = {s for s in seg_slot if s >= 0}
    return LoRABatchMeta(
        token_perm=perm.to(device),
        seg_starts=torch.tensor(seg_starts, dtype=torch.int32, device=device),
        seg_slot=torch.tensor(seg_slot, dtype=torch.int32, device=device),
        slot_rank=torch.tensor(slot_rank, dtype=torch.int32, device=device),
        num_tokens=len(token_slots),
        num_segments=len(seg_slot),
        max_seg_len=max(seg_starts[g + 1] - seg_starts[g] for g in range(len(seg_slot))),
        max_rank=max((slot_rank[s] for s in present), default=0),
        seg_starts_host=seg_starts,
        seg_slot_host=seg_slot,
        slot_rank_host=list(slot_rank),
    )


def spread_slots(num_tokens: int, num_adapters: int) -> list[int]:
    """Token ``t`` uses adapter ``t % num_adapters`` (0 adapters: every token base-only)."""
    return [t % num_adapters if num_adapters else -1 for t in range(num_tokens)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN if out holds a NaN)."""
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def bench_ms(fn, on_gpu: bool) -> float:
    """Median milliseconds of ``fn``. GPU: triton's do_bench (CUDA events; it flushes L2 between
    runs, so adapter weights are read from HBM each time). CPU smoke: a wall-clock median that
    only exercises the code path; it is no GPU figure."""
    if on_gpu:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))
    times = []
    for _ in range(1):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


class Report:
    """Lines printed as they come and kept for ``results.md``; targets collected for a summary."""

    def __init__(self, title: str):
        self.lines: list[str] = [f"# {title}", ""]
        self.targets: list[str] = []
        self.failures: list[str] = []

    def line(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def table(self, header: list[str], rows: list[list[object]]) -> None:
        self.line("| " + " | ".join(header) + " |")
        self.line("|" + " --- |" * len(header))
        for row in rows:
            self.line("| " + " | ".join(str(c) for c in row) + " |")
        self.line()

    def check(self, name: str, ok: bool, detail: str) -> None:
        text = f"{'PASS' if ok else 'FAIL'} {name}: {detail}"
        self.line(text)
        if not ok:
            self.failures.append(text)

    def raised(self, name: str) -> None:
        """Report the exception being handled as a failure of ``name``, with its traceback."""
        self.line(f"{name} FAILED:")
        self.line("```\n" + traceback.format_exc() + "```")
        self.failures.append(f"{name} raised")

    def target(self, text: str) -> None:
        self.targets.append(text)

    def write(self) -> Path | None:
        out_dir = os.environ.get("OUT")
        if not out_dir:
            return None
        path = Path(out_dir) / "results.md"
        path.write_text("\n".join(self.lines) + "\n")
        return path


def run_section(report: Report, name: str, fn, *args) -> None:
    """Run one section; an exception is reported as a failure and the later sections still run
    (a device call is minutes of a short lease: one broken reference must not cost the rest)."""
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        report.raised(name)
    report.write()
