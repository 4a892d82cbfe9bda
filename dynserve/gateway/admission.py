"""Admission that keeps the time to first token of the requests it admits at a target, under any load.

A request's wait for its first token is its queueing behind the requests admitted before it that have not
had theirs (Little's law: the wait is that number over the fleet's prefill rate). `Admission` bounds that
number by a limit it adapts to what it observes, additive increase, multiplicative decrease: every
`window_s`, if the window's TTFT p90 was over the target the limit shrinks (by the ratio of target to p90,
between `decrease` and a half), and if the limit was reached while TTFTs met the target it grows by one plus
10%. Requests past the limit are refused at once
(429 with Retry-After), so overload costs the excess a quick retry instead of costing every request its TTFT.

Pure bookkeeping, no I/O: the clock is passed in. Invariant: 0 <= num_waiting; min_limit <= limit <= max_limit.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = ["Admission"]


class Admission:
    def __init__(self, ttft_target_s: float, *, initial_limit: float = 16.0, min_limit: float = 1.0,
                 max_limit: float = 4096.0, window_s: float = 1.0, decrease: float = 0.75,
                 clock: Callable[[], float]) -> None:
        if not 0 < min_limit <= initial_limit <= max_limit or not 0 < decrease < 1 or ttft_target_s <= 0:
            raise ValueError("need 0 < min_limit <= initial_limit <= max_limit, 0 < decrease < 1, a target > 0")
        self.ttft_target_s, self.window_s, self.decrease = ttft_target_s, window_s, decrease
        self.min_limit, self.max_limit = min_limit, max_limit
        self.limit = initial_limit
        self.num_waiting = 0  # admitted, no first token yet
        self._clock = clock
        self._window_end_s = clock() + window_s
        self._ttfts_s: list[float] = []
        self._saturated = False  # the limit refused or was reached in this window

    def try_admit(self) -> bool:
        """Admit one more request (True), or refuse it: as many wait for their first token as the limit."""
        self._roll()
        if self.num_waiting >= math.floor(self.limit):
            self._saturated = True
            return False
        self.num_waiting += 1
        if self.num_waiting >= math.floor(self.limit):
            self._saturated = True
        return True

    def first_token(self, ttft_s: float) -> None:
        """An admitted request had its first token after `ttft_s`."""
        self.num_waiting -= 1
        self._ttfts_s.append(ttft_s)
        self._roll()

    def abandon(self) -> None:
        """An admitted request ended without a first token (an error, a disconnect)."""
        self.num_waiting -= 1

    def _roll(self) -> None:
        now_s = self._clock()
        if now_s < self._window_end_s:
            return
        if self._ttfts_s:
            ttfts = sorted(self._ttfts_s)
            p90 = ttfts[min(len(ttfts) - 1, math.ceil(0.9 * len(ttfts)) - 1)]
            if p90 > self.ttft_target_s:  # down by how far over, by `decrease` at least, by half at most
                factor = min(self.decrease, max(0.5, self.ttft_target_s / p90))
                self.limit = max(self.min_limit, self.limit * factor)
            elif self._saturated:
                self.limit = min(self.max_limit, self.limit + 1 + 0.1 * self.limit)
        self._ttfts_s.clear()
        self._saturated = self.num_waiting >= math.floor(self.limit)
        self._window_end_s = now_s + self.window_s

    def check_integrity(self) -> None:
        assert self.num_waiting >= 0, self.num_waiting
        assert self.min_limit <= self.limit <= self.max_limit, self.limit
