"""`dynserve.shutdown.step`: a shutdown step that ends, fails, or never ends (even one that swallows its
cancellation) costs at most its timeout, and a warning names the one left behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import pytest

from dynserve.shutdown import step


def test_a_step_that_ends_in_time_is_waited_for() -> None:
    ran = []

    async def close() -> None:
        await asyncio.sleep(0.01)
        ran.append(True)

    assert asyncio.run(step("the thing", close(), 5.0)) is True
    assert ran == [True]


def test_a_step_that_never_ends_is_left_behind_with_its_name(caplog: pytest.LogCaptureFixture) -> None:
    """Even one that swallows its cancellation (a task whose cancel got lost) costs only the timeout."""
    cancels = []

    async def stubborn() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancels.append(True)  # swallowed: keeps going

    async def main() -> tuple[bool, float]:
        start_s = time.monotonic()
        done = await step("pool decode", stubborn(), 0.2)
        elapsed_s = time.monotonic() - start_s
        await asyncio.sleep(0)  # the cancellation reaches the task
        for task in asyncio.all_tasks() - {asyncio.current_task()}:  # asyncio.run would wait for it forever
            task.get_coro().close()  # type: ignore[union-attr]
        return done, elapsed_s

    with caplog.at_level(logging.WARNING, logger="dynserve.shutdown"):
        done, elapsed_s = asyncio.run(main())
    assert done is False and 0.2 <= elapsed_s < 2.0 and cancels == [True]
    assert "shutdown: pool decode still running after 0.2 s" in caplog.text


def test_a_failed_step_is_logged_and_the_next_steps_run(caplog: pytest.LogCaptureFixture) -> None:
    async def broken() -> None:
        raise ConnectionError("reset by peer")

    async def main() -> list[bool]:
        return [await step("the Redis connections", broken(), 1.0), await step("next", asyncio.sleep(0), 1.0)]

    with caplog.at_level(logging.WARNING, logger="dynserve.shutdown"):
        assert asyncio.run(main()) == [False, True]
    assert "shutdown: the Redis connections failed (ConnectionError('reset by peer'))" in caplog.text


def test_cancelling_the_caller_cancels_the_step() -> None:
    async def main() -> bool:
        inner = asyncio.ensure_future(asyncio.sleep(3600))
        outer = asyncio.ensure_future(step("slow", inner, 60.0))
        await asyncio.sleep(0.01)
        outer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await outer
        await asyncio.sleep(0)
        return inner.cancelled()

    assert asyncio.run(main()) is True


def test_a_step_left_behind_is_held_and_its_late_error_logged(caplog: pytest.LogCaptureFixture) -> None:
    """A step that outlives its timeout and then fails in its cleanup: held until it ends (not collected
    mid-flight), its error logged then (not "Task exception was never retrieved")."""
    from dynserve import shutdown

    async def slow_then_broken() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)
            raise ConnectionError("closed under it") from None

    async def main() -> tuple[bool, int, int]:
        done = await step("the Redis connections", slow_then_broken(), 0.05)
        held = len(shutdown._left_behind)
        await asyncio.sleep(0.2)
        return done, held, len(shutdown._left_behind)

    with caplog.at_level(logging.WARNING, logger="dynserve.shutdown"):
        assert asyncio.run(main()) == (False, 1, 0)
    assert "a step left behind failed at last (ConnectionError('closed under it'))" in caplog.text


def test_steps_in_a_budget_share_it_from_the_first_step_on(monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Four steps that never end, each allowed 60 s, inside a 1 s budget (and a 100 s one within it, which
    the outer one overrules): a step's own shorter timeout still wins, the next gets what is left of the
    budget, and the ones after a spent budget the floor; the time before the first step is not counted."""
    from dynserve import shutdown

    monkeypatch.setattr(shutdown, "MIN_STEP_S", 0.2)

    async def main() -> list[float]:
        took = []
        with shutdown.budget(1.0):
            await asyncio.sleep(0.5)  # the drain before the steps: not the budget's
            with shutdown.budget(100.0):
                for name, timeout_s in (("short", 0.3), ("first", 60.0), ("second", 60.0), ("third", 60.0)):
                    start_s = time.monotonic()
                    assert await step(name, asyncio.sleep(3600), timeout_s) is False
                    took.append(time.monotonic() - start_s)
        return took

    with caplog.at_level(logging.WARNING, logger="dynserve.shutdown"):
        short, first, second, third = asyncio.run(main())
    assert 0.3 <= short < 0.6, short
    assert first >= 0.35 and 0.95 <= short + first < 1.4, first  # the 1 s budget less the short step's time
    assert 0.2 <= second < 0.6 and 0.2 <= third < 0.6, (second, third)
    assert "shutdown: first still running after 0." in caplog.text


def test_without_a_budget_each_step_has_its_own_timeout() -> None:
    async def main() -> float:
        start_s = time.monotonic()
        for _ in range(2):
            await step("slow", asyncio.sleep(3600), 0.3)
        return time.monotonic() - start_s

    assert 0.6 <= asyncio.run(main()) < 1.5
