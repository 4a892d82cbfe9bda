"""What the whole machine did, second by second, while a benchmark ran: Linux's pressure stall information
(`/proc/pressure/{cpu,io,memory}`: the time some task, or every task, was runnable but waiting for a core,
waiting on I/O, or waiting on memory reclaim), major page faults, tasks created (`/proc/vmstat`,
`/proc/stat`'s `processes`: every fork and clone, so threads too; a Ray worker process's start is about 30)
and the cores busy.

A benchmark whose client falls behind (its sends late) at some moments cannot tell from its own figures
whether the cores were all busy, the disk was read (code pages evicted, a process start reading its
libraries) or memory was reclaimed; `PressureSampler` records that beside the run, and `around` reads the
seconds near a moment of interest. The counters are cumulative (PSI's `total` is microseconds since boot),
so sampling every `period_s` loses nothing between samples; what is kept is one row per whole second.
Where the kernel has no PSI (an older one, or `psi=0`), those columns are None.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

from benchmarks._common import BackgroundLoop

__all__ = ["PressureSampler", "Reading", "around", "read_counters", "rows_between"]

_PSI = Path("/proc/pressure")
COLUMNS = ("cpu_some_ms", "io_some_ms", "io_full_ms", "memory_some_ms", "memory_full_ms", "major_faults",
           "new_tasks", "busy_cores")


@dataclass(frozen=True)
class Reading:
    """The machine's cumulative counters at one moment (monotonic seconds `t_s`)."""

    t_s: float
    psi_us: dict[str, int | None]  # "cpu_some", "io_some", "io_full", "memory_some", "memory_full"
    major_faults: int
    new_tasks: int  # processes and threads created since boot
    busy_ticks: int  # all CPUs' non-idle jiffies


def _psi(resource: str) -> dict[str, int | None]:
    """{"some": total µs, "full": total µs} of /proc/pressure/<resource> (None: the kernel has none)."""
    try:
        text = (_PSI / resource).read_text()
    except OSError:
        return {"some": None, "full": None}
    out: dict[str, int | None] = {"some": None, "full": None}
    for line in text.splitlines():
        kind, *fields = line.split()
        for field in fields:
            if field.startswith("total="):
                out[kind] = int(field[len("total="):])
    return out


def read_counters(now_s: float | None = None) -> Reading:
    """One reading of every counter (about 0.1 ms of CPU)."""
    psi: dict[str, int | None] = {}
    for resource in ("cpu", "io", "memory"):
        for kind, total in _psi(resource).items():
            psi[f"{resource}_{kind}"] = total
    major_faults = 0
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("pgmajfault "):
            major_faults = int(line.split()[1])
            break
    new_tasks = busy = 0
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu "):
            # user nice system idle iowait irq softirq steal ...: busy is all but idle and iowait
            ticks = [int(v) for v in line.split()[1:]]
            busy = sum(ticks) - ticks[3] - ticks[4]
        elif line.startswith("processes "):
            new_tasks = int(line.split()[1])
    return Reading(time.monotonic() if now_s is None else now_s, psi, major_faults, new_tasks, busy)


def _row(t_s: float, before: Reading, after: Reading, clock_ticks: int) -> dict[str, Any]:
    """What happened between two readings, as one row: stall milliseconds per PSI line, faults, new tasks,
    cores busy on average."""

    def stalled_ms(key: str) -> float | None:
        a, b = before.psi_us[key], after.psi_us[key]
        return None if a is None or b is None else round((b - a) / 1e3, 1)

    span_s = max(1e-9, after.t_s - before.t_s)
    return {
        "t_s": round(t_s, 2),
        "cpu_some_ms": stalled_ms("cpu_some"), "io_some_ms": stalled_ms("io_some"),
        "io_full_ms": stalled_ms("io_full"), "memory_some_ms": stalled_ms("memory_some"),
        "memory_full_ms": stalled_ms("memory_full"),
        "major_faults": after.major_faults - before.major_faults,
        "new_tasks": after.new_tasks - before.new_tasks,
        "busy_cores": round((after.busy_ticks - before.busy_ticks) / clock_ticks / span_s, 2),
    }


class PressureSampler(BackgroundLoop):
    """A thread reading the counters every `period_s` from `start_s` (monotonic; default: when started) and
    keeping one row a second (seconds since `start_s`). Use as a context manager; `rows` after it exits."""

    def __init__(self, start_s: float | None = None, *, period_s: float = 0.05) -> None:
        import os

        super().__init__("pressure-sampler")
        self.start_s = start_s
        self.period_s = period_s
        self.rows: list[dict[str, Any]] = []
        self._clock_ticks = os.sysconf("SC_CLK_TCK")

    def __enter__(self) -> Self:
        self._first = read_counters()  # before the caller goes on: nothing it does escapes the first row
        if self.start_s is None:
            self.start_s = self._first.t_s
        return super().__enter__()

    def _run(self) -> None:
        assert self.start_s is not None
        last = second_start = self._first
        while not self._stop.wait(self.period_s):
            last = read_counters()
            if last.t_s - second_start.t_s >= 1.0:
                self.rows.append(_row(second_start.t_s - self.start_s, second_start, last, self._clock_ticks))
                second_start = last
        if last.t_s > second_start.t_s:
            self.rows.append(_row(second_start.t_s - self.start_s, second_start, last, self._clock_ticks))


def rows_between(rows: Sequence[dict[str, Any]], from_s: float, to_s: float) -> list[dict[str, Any]]:
    """The rows whose second starts in [from_s, to_s)."""
    return [row for row in rows if from_s <= row["t_s"] < to_s]


def around(rows: Sequence[dict[str, Any]], from_s: float, to_s: float) -> dict[str, Any]:
    """The rows of [from_s, to_s) summed (stall milliseconds, faults, new tasks) and the busiest second's
    cores: what the machine did in a window of interest. A column the kernel lacks, or a window with no
    rows, is None (unknown), not 0."""
    chosen = rows_between(rows, from_s, to_s)
    out: dict[str, Any] = {"from_s": from_s, "to_s": to_s, "seconds": len(chosen)}
    for column in COLUMNS:
        values = [row[column] for row in chosen if row[column] is not None]
        if column == "busy_cores":
            out["busy_cores_max"] = max(values, default=None)
            out["busy_cores_mean"] = round(sum(values) / len(values), 2) if values else None
        else:
            out[column] = round(sum(values), 1) if values else None
    return out
