"""Helpers every benchmark shares: the commit and machine a result came from, progress lines, timing,
percentiles, and writing the result JSON (last stdout line plus a file under `benchmarks/results/`).
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Self

__all__ = ["RESULTS_DIR", "BackgroundLoop", "best_time_s", "client_priority", "file_tail", "git_commit",
           "log", "machine_info", "percentile", "start_local_ray", "write_result"]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
_REPO_ROOT = Path(__file__).resolve().parent.parent


def start_local_ray(*, with_system_config: bool = True, **kwargs: Any) -> None:
    """`ray.init(**kwargs)` of a local Ray as dynserve starts one (`dynserve.workers.ray_start`): one host by
    construction, so workers serve on loopback (an address the Ray processes inherit from this process's
    environment), started at niceness 0 by its system config (`with_system_config=False`: as a user might
    start one, without it)."""
    import ray

    from dynserve.config import ray_system_config

    os.environ["DYN_ADVERTISE_HOST"] = "127.0.0.1"
    ray.init(**({"_system_config": ray_system_config()} if with_system_config else {}), **kwargs)


def log(message: str) -> None:
    """A human-readable progress line on stderr (stdout's last line is reserved for the JSON result)."""
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def git_commit() -> str | None:
    """HEAD of the repository the benchmark runs from, or None outside a git checkout."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=_REPO_ROOT, capture_output=True, text=True, timeout=10,
            check=True,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() or None


def machine_info() -> dict[str, Any]:
    """Where a result came from; torch's fields only when torch is already loaded (the mocker benchmarks
    never load it)."""
    torch = sys.modules.get("torch")
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__ if torch else None,
        "torch_num_threads": torch.get_num_threads() if torch else None,
        "cuda": torch.cuda.get_device_name(0) if torch and torch.cuda.is_available() else None,
        "load_avg_1m": os.getloadavg()[0],  # other work on the machine skews timings; judge by this
    }


def file_tail(path: Path, num_chars: int = 3000) -> str:
    """The last `num_chars` of a log file ("" when it cannot be read): what a failed server said last."""
    try:
        return path.read_text(errors="replace")[-num_chars:]
    except OSError:
        return ""


def best_time_s(fn: Callable[[], object], repeats: int) -> float:
    """The fastest of `repeats` timed calls: the one least disturbed by other load on the machine."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated q-th percentile (0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def write_result(name: str, result: Mapping[str, Any], output: Path | None = None) -> Path:
    """Write `result` to `output` (default `benchmarks/results/<name>-<timestamp>.json`) and print it as
    the last stdout line. Returns the file written."""
    path = output or RESULTS_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result, sort_keys=True)
    path.write_text(text + "\n")
    log(f"wrote {path}")
    print(text, flush=True)
    return path


@contextlib.contextmanager
def client_priority(niceness: int = -10) -> Iterator[int | None]:
    """Runs the calling thread (and the threads it starts meanwhile) at `niceness`, then restores it: a load
    generator on the machine of the fleet it measures, at the fleet's priority, competes with the fleet for
    the cores, and its late sends and late reads would count against the fleet. Yields the niceness in force,
    or None where it could not be raised (not root): then the client runs as before, and the result says
    so."""
    before = os.getpriority(os.PRIO_PROCESS, 0)  # on Linux the calling thread's
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except PermissionError:
        log(f"client priority: cannot set niceness {niceness} (not root); the client runs at {before}")
        yield None
        return
    try:
        yield niceness
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


class BackgroundLoop(abc.ABC):
    """A daemon thread that runs `_run` from `__enter__` until `__exit__`, which sets `_stop` and joins it:
    the benchmarks' pollers and samplers. `_run` must return soon after `_stop` is set (wait on it between
    reads). A thread started inside `client_priority` runs at the client's priority."""

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @abc.abstractmethod
    def _run(self) -> None:
        """The loop itself: each subclass's reads, until `_stop` is set."""
