"""The suite's own contracts: collecting it imports nothing heavy, and the markers `make test-fast` selects by
come from the fixtures each test reaches (tests/conftest.py), so a test cannot slip into the fast set while
starting Ray or loading the model. One collection of the whole suite, in a fresh interpreter, serves both."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
HEAVY = {"model", "ray", "fleet", "services", "netns", "install", "fuzz"}  # what `make test-fast` leaves out

_COLLECT = """
import sys, pytest
class Report:
    def pytest_collection_finish(self, session):
        for item in session.items:
            print("ITEM", item.nodeid, ",".join(sorted(m.name for m in item.iter_markers())), sep="\\t")
code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "tests"], plugins=[Report()])
print("HEAVY", ",".join(sorted(m for m in ("torch", "transformers", "ray", "triton", "nixl") if m in sys.modules)))
sys.exit(code)
"""


@pytest.fixture(scope="module")
def collected() -> tuple[dict[str, set[str]], str]:
    """(each test's markers by node id, the heavy modules collection imported)."""
    done = subprocess.run([sys.executable, "-c", _COLLECT], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    markers: dict[str, set[str]] = {}
    heavy = ""
    for line in done.stdout.splitlines():
        if line.startswith("ITEM\t"):
            _, nodeid, names = line.split("\t")
            markers[nodeid] = set(filter(None, names.split(",")))
        elif line.startswith("HEAVY "):
            heavy = line.removeprefix("HEAVY ")
    return markers, heavy


def test_collecting_the_whole_suite_imports_no_torch_ray_or_triton(collected: tuple[dict[str, set[str]], str]) -> None:
    markers, heavy = collected
    assert len(markers) > 800 and heavy == "", heavy


def test_tests_reaching_the_model_or_ray_are_marked_so_and_left_out_of_the_fast_set(
        collected: tuple[dict[str, set[str]], str]) -> None:
    markers, _ = collected
    fast = {nodeid for nodeid, names in markers.items() if not names & HEAVY}
    # the gateway's tests all reach the real model (through `gateway`, ...); the engine's too, but those over
    # the tiny random-weight model (`make_tiny_engine`: its mechanics, any weights)
    assert not [n for n in fast if n.startswith("tests/test_gateway.py")]
    assert "model" in markers["tests/test_gateway.py::test_disconnect_frees_the_workers_blocks_within_1s"]
    assert "model" in markers["tests/test_engine.py::test_stop_strings_and_finish_reasons"]
    # the mocker's pure tests stay; the ones starting a fleet on Ray go
    assert any(n.startswith("tests/test_mocker.py") for n in fast)
    for started in ("test_dynctl_serve_mocker_answers_with_two_workers", "test_dynctl_serve_mocker_disaggregated",
                    "test_a_mocker_actor_imports_no_torch_and_reserves_a_hundredth_of_a_cpu"):
        assert {"fleet", "ray"} <= markers[f"tests/test_mocker.py::{started}"]
    assert len(fast) >= 400


def test_waiting_for_a_silent_process_ends_at_its_deadline() -> None:
    """`wait_for_line` kills a process that writes nothing by the deadline (a blocked read would hang the
    run)."""
    from conftest import wait_for_line

    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], stderr=subprocess.PIPE,
                               text=True)
    start_s = time.monotonic()
    with pytest.raises(AssertionError, match="within 1"):
        wait_for_line(process, "never", 1)
    assert time.monotonic() - start_s < 10 and process.wait(10) != 0
    process.stderr.close()  # type: ignore[union-attr]


_CHATTY_UNTIL_SIGINT = """
import signal, sys, time
{handler}
sys.stderr.write("ready\\n"); sys.stderr.flush()
for i in range(4000):  # 400 KiB: far past a pipe's 64 KiB, so an unread pipe would block this writer
    sys.stderr.write(f"{{i:07d}} " + "x" * 92 + "\\n")
sys.stderr.write("written\\n"); sys.stderr.flush()
time.sleep(60)
"""


@pytest.mark.parametrize("ignores_sigint", [False, True])
def test_a_drained_fleet_never_blocks_on_its_stderr_and_a_hang_shows_its_log(ignores_sigint: bool) -> None:
    """`local_dynctl_serve` drains a fleet's stderr (`StderrDrain`): a process that writes far more than a
    pipe holds after its banner still stops on Ctrl-C with all of it read, and one that ignores Ctrl-C fails
    its test with the end of its log instead of a bare timeout."""
    from conftest import StderrDrain, stop_by_sigint, wait_for_line

    handler = "signal.signal(signal.SIGINT, signal.SIG_IGN)" if ignores_sigint else ""
    process = subprocess.Popen([sys.executable, "-c", _CHATTY_UNTIL_SIGINT.format(handler=handler)],
                               stderr=subprocess.PIPE, text=True)
    wait_for_line(process, "ready", 30)
    drain = StderrDrain(process)
    drain.start()
    deadline_s = time.monotonic() + 30
    while not any("written" in line for line in drain.lines[-2:]):
        assert time.monotonic() < deadline_s, "the writer blocked: its pipe was not drained"
        time.sleep(0.05)
    if ignores_sigint:
        with pytest.raises(AssertionError, match=r"(?s)did not exit within 1 s of Ctrl-C.*written"):
            stop_by_sigint(process, drain, timeout_s=1)
        assert process.poll() is not None
    else:
        code, rest = stop_by_sigint(process, drain, timeout_s=10)
        assert code != 0 and rest.count("x" * 92) == 4000
