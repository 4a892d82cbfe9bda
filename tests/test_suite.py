"""The suite's own contracts: collecting it imports nothing heavy, and the markers `make test-fast` selects by
come from the fixtures each test reaches (tests/conftest.py), so a test cannot slip into the fast set while
starting Ray or loading the model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _collect(*args: str) -> subprocess.CompletedProcess[str]:
    code = ("import sys, pytest\n"
            f"code = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', *{list(args)!r}])\n"
            "heavy = sorted(m for m in ('torch', 'transformers', 'ray', 'triton', 'nixl') if m in sys.modules)\n"
            "print('HEAVY', ','.join(heavy))\n"
            "sys.exit(code)\n")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_collecting_the_whole_suite_imports_no_torch_ray_or_triton() -> None:
    done = _collect("tests")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "HEAVY \n" in done.stdout, done.stdout.splitlines()[-1]


def test_tests_reaching_the_model_or_ray_are_marked_so_and_left_out_of_the_fast_set() -> None:
    heavy = "model or ray or fleet or services or netns or install or fuzz"
    fast = _collect("-m", f"not ({heavy})", "tests/test_gateway.py", "tests/test_engine.py", "tests/test_mocker.py")
    assert fast.returncode == 0, fast.stdout[-3000:]
    selected = [line for line in fast.stdout.splitlines() if "::" in line]
    # the gateway's and the engine's tests all reach the real model (through `gateway`, `make_engine`, ...)
    assert not [n for n in selected if n.startswith(("tests/test_gateway.py", "tests/test_engine.py"))], selected
    # the mocker's pure tests stay; the ones starting a fleet on Ray go
    assert any(n.startswith("tests/test_mocker.py") for n in selected)
    for started in ("test_dynctl_serve_mocker_answers_with_two_workers", "test_dynctl_serve_mocker_disaggregated",
                    "test_a_mocker_actor_imports_no_torch_and_reserves_a_hundredth_of_a_cpu"):
        assert f"tests/test_mocker.py::{started}" not in selected
    model = _collect("-m", "model", "tests/test_gateway.py")
    assert "test_disconnect_frees_the_workers_blocks_within_1s" in model.stdout
