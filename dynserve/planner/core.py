"""The planner's decision core: one observation of the fleet in, the next worker count of each pool out. No
I/O and no clock of its own (the time is the observation's), so the same core runs live
(`planner/live.py`), in trace replay (`benchmarks/planner.py`) and in tests.

Pools are named by their workers' role: `prefill` and `decode` when serving disaggregated, `both` when not.
Two modes (`PlannerConfig.mode`):

- **sla**: predict the request rate, mean ISL and mean OSL (`predictors.py`; each never below what the last
  window observed) at the *horizon*: when a worker decided now would serve, and as read the rate is already
  half a read window old, so the horizon is the worker start time (`start_s`, or as this core measures it:
  from a scale-up's decision to the observation that shows its workers serving) plus half of
  `read_window_s`, and at least one interval. Turn them into replicas with the capacity profile (`profile.py`:
  the prompt tokens/s a prefill worker sustains at the TTFT target, by ISL; the tokens/s a decode worker
  sustains at the ITL target, by context length), and correct each pool's need by how its observed TTFT
  (prefill) or ITL (decode) compares with what the profile expects at the load it carries now (an EWMA of
  observed / expected, bounded): a fleet slower than its profile gets more workers (one faster keeps the
  profile's count: `correction_bounds`). A `both` pool needs the sum of the two (its workers do both).
  **Rise headroom**: while the predicted rate rises (the prediction at the horizon over the predictor's
  level by `rise_threshold`: Holt's trend; a constant or EWMA predictor never rises) and that rate alone
  fills `rise_min_need` of a prefill worker at the ISL the model usually sees (a slow EWMA of the windows'
  mean ISL), a pool that prefills (`prefill`, `both`) whose need is at least `rise_min_need` keeps
  `rise_spare_workers` over its need: a worker decided now serves only after a start, and the next step of
  a rise (a burst of arrivals on a busy model) can come before it. A trickle whose need reads high on one
  long prompt or a pair of arrivals, and a flat or falling load, get no spare.
- **load**: no profile; a pool grows when its observed TTFT (prefill, both) or ITL (decode, both) is over its
  target or its queue is over `load_queue_per_worker` a worker, and shrinks when every signal is comfortably
  under (below `load_headroom` x target, nothing queued).

Either way, and in this order: a pool grows by at most `max_step_up` an interval and shrinks by at most
`max_step_down`, only after the lower need has held for `down_delay_s` (every decision since saw it) and with
a `down_margin` of spare capacity (so noisy flat load does not flap); bounds per pool (`min_workers`,
`max_workers`) and a `max_total_workers` budget shared by the pools (the pool with the most spare capacity
gives first); **scale to zero** after `idle_s` with no request at all, and **wake** at once (a serving pool
to at least one worker) when a request arrives for a fleet at zero (the gateway holds it meanwhile); a
**manual override** (`override`) fixes a pool's count until `release`, and the budget left to the others
shrinks by it.

Several models, one budget: each model has its own core (its own pools, predictors and corrections) and all
share a `SharedBudget`. A core may grow only into what the other models leave (`allowance`); a core the budget
cut is `squeezed`, and while another model is squeezed every other core shrinks its pools that carry more
than they need at once (reason `yield`: no down delay, no step limit, never below the pool's floor), so the
workers move to where the load is.

Invariants: every decided count is within [0, max_workers] of its pool (an override within [0, its max]);
the decided counts never exceed `max_total_workers` unless overrides alone do; below `min_workers` only
when idle (scale to zero) or overridden.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from dynserve.planner.predictors import EwmaPredictor, PredictorName, make_predictor

if TYPE_CHECKING:
    from dynserve.planner.profile import CapacityProfile

__all__ = ["POOLS", "Decision", "Observation", "PlannerConfig", "PlannerCore", "PoolObservation", "SharedBudget"]

POOLS = ("prefill", "decode", "both")
_USUAL_ISL_ALPHA = 0.1  # the weight of a window's mean ISL in the usual ISL a rise's spare is judged at
_SERVING = ("decode", "both")  # a fleet needs one of these to answer at all (prefill alone cannot)
NAN = math.nan


@dataclass(frozen=True, slots=True)
class PoolObservation:
    """One pool as observed over the last window: its serving workers (and those still starting), their TTFT
    and ITL (the statistic the connector reads, NaN without observations), and their queued and running
    requests (sums)."""

    num_workers: int
    ttft_s: float = NAN
    itl_s: float = NAN
    num_waiting: float = 0.0
    num_running: float = 0.0
    num_starting: int = 0  # workers started and not serving yet


@dataclass(frozen=True, slots=True)
class Observation:
    """The fleet at `now_s` (any clock, seconds): the gateway's request rate and mean ISL and OSL over the
    last window (NaN when it saw no requests), each pool, and the requests the gateway holds because no
    worker is ready (waiting for a scale from zero)."""

    now_s: float
    pools: Mapping[str, PoolObservation]
    request_rate_per_s: float = NAN
    mean_isl: float = NAN
    mean_osl: float = NAN
    num_waiting_for_worker: int = 0


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    mode: Literal["sla", "load"] = "sla"
    ttft_target_s: float = 1.0
    itl_target_s: float = 0.05
    interval_s: float = 10.0
    min_workers: Mapping[str, int] = field(default_factory=dict)  # per pool; default 1
    max_workers: Mapping[str, int] = field(default_factory=dict)  # per pool; default 8
    max_total_workers: int | None = None
    idle_s: float | None = None  # scale every pool to zero after this long without a request; None: never
    predictor: PredictorName = "holt"
    read_window_s: float = 0.0  # the window the observed rates average over (its middle is what they tell)
    start_s: float | None = None  # a new worker's time to serve; None: measured, from one interval at first
    start_alpha: float = 0.5  # the weight of a new start time in the measured one
    max_step_up: int = 4
    max_step_down: int = 1
    down_delay_s: float | None = None  # shrink once a lower need has held this long (counting its first
    # interval); None: three intervals
    down_margin: float = 0.15  # shrink only when the need fits in one worker fewer with this much to spare
    load_headroom: float = 0.6
    load_queue_per_worker: float = 2.0
    correction_alpha: float = 0.3
    # a fleet slower than its profile gets more workers; one faster keeps the profile's count: the profile's
    # queue (one prefill at a time) is pessimistic where prefills batch, and correcting below it starved the
    # pool as load rose (benchmarks.planner)
    correction_bounds: tuple[float, float] = (1.0, 3.0)
    # rise headroom (see the module doc): on the multimodel benchmark's rises a model's arrivals jumped from
    # 2 to 6-10 req/s within 2-3 s while its next prefill worker took 3-6 s to serve
    rise_spare_workers: int = 1
    rise_threshold: float = 0.1
    # 0.8, not 0.65: a trickle (0.3 req/s) whose 3 s window holds 3-4 arrivals reads a rising rate and a need
    # of 0.65-0.86, and at 0.65 about one of those blips in two started a worker it never used; 0.8 leaves
    # them a third fewer starts and the rises their spare (benchmarks/_multimodel_whatif.py, docs/benchmarks.md)
    rise_min_need: float = 0.8

    def min_of(self, pool: str) -> int:
        return self.min_workers.get(pool, 1)

    def max_of(self, pool: str) -> int:
        return self.max_workers.get(pool, 8)


@dataclass(frozen=True, slots=True)
class Decision:
    """The worker count each pool should have, why (`reasons`: sla_up, sla_down, load_up, load_down, yield,
    hold, idle, wake, override, budget, bound), and what the SLA mode predicted and needed (NaN in load mode);
    `rising`: the sla mode saw the rate rising (its prefilling pools got `rise_spare_workers` over their
    need)."""

    now_s: float
    targets: dict[str, int]
    reasons: dict[str, str]
    needs: dict[str, float]
    corrections: dict[str, float]
    predicted_rate_per_s: float = NAN
    predicted_isl: float = NAN
    predicted_osl: float = NAN
    horizon_s: float = NAN  # how far ahead the predictions are (sla mode)
    rising: bool = False

    def changed(self, previous: Mapping[str, int]) -> dict[str, int]:
        """The pools whose target differs from `previous`, and their new targets."""
        return {pool: n for pool, n in self.targets.items() if previous.get(pool) != n}


class SharedBudget:
    """`total` workers shared by the cores of several models (members, by name): what each has decided, and
    which of them the budget cut at their last decision."""

    def __init__(self, total: int) -> None:
        if total < 1:
            raise ValueError(f"a shared budget needs at least one worker, not {total}")
        self.total = total
        self._decided: dict[str, int] = {}
        self._squeezed: set[str] = set()

    def allowance(self, member: str) -> int:
        """The workers `member` may have: the total less what the others have decided."""
        return self.total - sum(n for other, n in self._decided.items() if other != member)

    def others_squeezed(self, member: str) -> bool:
        return bool(self._squeezed - {member})

    def record(self, member: str, num_workers: int, *, squeezed: bool) -> None:
        self._decided[member] = num_workers
        if squeezed:
            self._squeezed.add(member)
        else:
            self._squeezed.discard(member)

    def decided(self) -> dict[str, int]:
        return dict(self._decided)


class PlannerCore:
    """Decides each pool's worker count, one `decide` per interval (see the module doc)."""

    def __init__(self, config: PlannerConfig, pools: Sequence[str], profile: CapacityProfile | None = None, *,
                 budget: SharedBudget | None = None, member: str = "") -> None:
        """`budget` shared with other models' cores (`member`: this core's name in it), on top of
        `config.max_total_workers`."""
        unknown = [p for p in pools if p not in POOLS]
        if unknown or not pools:
            raise ValueError(f"pools must be some of {POOLS}, got {list(pools)}")
        if config.mode == "sla" and profile is None:
            raise ValueError("the sla mode needs a capacity profile")
        if config.rise_spare_workers < 0 or config.rise_threshold < 0 or config.rise_min_need < 0:
            raise ValueError(f"rise_spare_workers ({config.rise_spare_workers}), rise_threshold "
                             f"({config.rise_threshold}) and rise_min_need ({config.rise_min_need}) "
                             "must be >= 0")
        for pool in pools:
            if not 0 <= config.min_of(pool) <= config.max_of(pool):
                raise ValueError(f"pool {pool}: min_workers {config.min_of(pool)} and max_workers "
                                 f"{config.max_of(pool)} are not 0 <= min <= max")
        self.config, self.pools, self.profile = config, tuple(pools), profile
        self.budget, self.member = budget, member
        self._yielding = False  # another model is squeezed by the shared budget: shrink what is spare at once
        self._rate, self._isl, self._osl = (make_predictor(config.predictor) for _ in range(3))
        self._usual_isl = EwmaPredictor(_USUAL_ISL_ALPHA)  # what a rise's spare is judged at
        self._observed_rate = 0.0
        self._observed_isl = self._observed_osl = NAN  # this window's means (NaN: no requests finished in it)
        self._last_full_s: float | None = None
        self.corrections = dict.fromkeys(self.pools, 1.0)
        self.targets: dict[str, int] | None = None  # the last decision's, once there is one
        self._lower_since: dict[str, float | None] = dict.fromkeys(self.pools)  # when each lower need began
        self._now_s = 0.0
        # scale-ups not serving yet, per pool: (decided at, the count that serves them); and the measured start
        self._growing: dict[str, list[tuple[float, int]]] = {p: [] for p in self.pools}
        self.measured_start_s: float | None = None
        self._last_active_s: float | None = None
        self._overrides: dict[str, int] = {}

    # ---- manual override ---------------------------------------------------------------------------------

    def override(self, pool: str, num_workers: int) -> None:
        """Hold `pool` at `num_workers` (within [0, its max]) until `release`."""
        if pool not in self.pools:
            raise ValueError(f"no pool {pool!r}; pools: {', '.join(self.pools)}")
        if not 0 <= num_workers <= self.config.max_of(pool):
            raise ValueError(f"pool {pool}: {num_workers} workers is outside [0, {self.config.max_of(pool)}]")
        self._overrides[pool] = num_workers

    def release(self, pool: str) -> None:
        self._overrides.pop(pool, None)

    @property
    def overrides(self) -> dict[str, int]:
        return dict(self._overrides)

    # ---- deciding ----------------------------------------------------------------------------------------

    def decide(self, observation: Observation) -> Decision:
        """The next targets. A decision less than half an interval after the last full one (a wake-up: a
        request waits for a fleet at zero, an override changed) applies only the wake, the overrides and
        the budget to the current targets: it neither feeds the predictors nor counts toward a shrink."""
        config, now_s = self.config, observation.now_s
        self._now_s = now_s
        self._measure_starts(observation)
        current = self.targets if self.targets is not None else {
            p: observation.pools[p].num_workers if p in observation.pools else config.min_of(p) for p in self.pools}
        full = self._last_full_s is None or now_s - self._last_full_s >= 0.5 * config.interval_s
        active = self._note_activity(observation)
        self._yielding = self.budget is not None and self.budget.others_squeezed(self.member)
        needs = dict.fromkeys(self.pools, NAN)
        rising = False
        if not full:
            targets, reasons = dict(current), dict.fromkeys(self.pools, "hold")
        else:
            self._last_full_s = now_s
            rate = observation.request_rate_per_s
            self._observed_rate = rate if math.isfinite(rate) else 0.0  # no requests in the window: a rate of 0
            self._rate.observe(self._observed_rate)
            self._observed_isl, self._observed_osl = observation.mean_isl, observation.mean_osl
            self._isl.observe(observation.mean_isl)
            self._usual_isl.observe(observation.mean_isl)
            self._osl.observe(observation.mean_osl)
            if config.mode == "sla":
                self._correct(observation)
                needs = self._sla_needs()
                rising = self._rising()
                targets, reasons = self._sla_targets(current, needs, rising=rising)
            else:
                targets, reasons = self._load_targets(current, observation)
        idle = (config.idle_s is not None and not active and self._last_active_s is not None
                and now_s - self._last_active_s >= config.idle_s)
        serving_pools = [p for p in _SERVING if p in self.pools]
        for pool in self.pools:
            if idle:
                targets[pool], reasons[pool] = 0, "idle"
            elif targets[pool] < config.min_of(pool) or (active and pool in serving_pools and targets[pool] < 1):
                # a fleet with requests keeps a worker to answer them, whatever the min (only idleness takes
                # a serving pool to zero)
                targets[pool], reasons[pool] = max(config.min_of(pool), 1 if pool in serving_pools else 0), "bound"
        if active and not any(current[p] for p in serving_pools):  # a request for a fleet at zero
            for pool in serving_pools:
                targets[pool], reasons[pool] = max(1, config.min_of(pool), targets[pool]), "wake"
        for pool, num in self._overrides.items():
            targets[pool], reasons[pool] = num, "override"
        self._apply_budget(targets, reasons, needs, keep_serving=not idle)
        if self.budget is not None:
            self.budget.record(self.member, sum(targets.values()),
                               squeezed=any(reasons[p] == "budget" for p in self.pools))
        for pool in self.pools:
            self._note_growth(pool, current[pool], targets[pool])
        self.targets = dict(targets)
        steps = self.horizon_s / config.interval_s
        return Decision(now_s, targets, reasons, needs, dict(self.corrections), _or_nan(self._rate.predict(steps)),
                        _or_nan(self._isl.predict()), _or_nan(self._osl.predict()),
                        self.horizon_s if config.mode == "sla" else NAN, rising)

    # ---- the horizon ---------------------------------------------------------------------------------------

    @property
    def start_s(self) -> float:
        """A new worker's time from decision to serving: the configured one, else the measured one, else one
        interval."""
        if self.config.start_s is not None:
            return self.config.start_s
        return self.measured_start_s if self.measured_start_s is not None else self.config.interval_s

    @property
    def horizon_s(self) -> float:
        """How far ahead of the observation the sla mode sizes: a worker's start plus half the read window."""
        return max(self.config.interval_s, self.start_s + self.config.read_window_s / 2)

    def _note_growth(self, pool: str, current: int, target: int) -> None:
        growing = self._growing[pool]
        if target > current:
            growing.append((self._now_s, target))
        elif target < current:  # a shrink: scale-ups above the new count will never serve
            growing[:] = [(t, n) for t, n in growing if n <= target]

    def _measure_starts(self, observation: Observation) -> None:
        """Each scale-up whose count of serving workers the observation reaches is one start time."""
        alpha = self.config.start_alpha
        for pool, growing in self._growing.items():
            seen = observation.pools.get(pool)
            if seen is None or not growing:
                continue
            done = [t for t, n in growing if n <= seen.num_workers]
            growing[:] = [(t, n) for t, n in growing if n > seen.num_workers]
            for decided_s in done:
                took = observation.now_s - decided_s
                self.measured_start_s = took if self.measured_start_s is None else (
                    alpha * took + (1 - alpha) * self.measured_start_s)

    def _note_activity(self, observation: Observation) -> bool:
        rate = observation.request_rate_per_s
        active = ((math.isfinite(rate) and rate > 0) or observation.num_waiting_for_worker > 0
                  or any(p.num_waiting > 0 or p.num_running > 0 for p in observation.pools.values()))
        if active or self._last_active_s is None:
            self._last_active_s = observation.now_s
        return active

    # ---- sla mode ----------------------------------------------------------------------------------------

    def _sla_needs(self) -> dict[str, float]:
        """Workers each pool needs for the predicted load (fractional), corrected."""
        assert self.profile is not None
        config, profile = self.config, self.profile
        # the predictor may see a rise coming, but never hides one already here (a smoothed prediction lags a
        # step up by intervals; scaling down is slow anyway, behind the down delay)
        rate = max(self._rate.predict(self.horizon_s / config.interval_s) or 0.0, self._observed_rate)
        # the same for the lengths: a window of longer prompts than predicted is sized for what it holds (a
        # model's few requests a window make its mean ISL noisy, and a low prediction under-sized the prefill
        # pool of a model whose load rose: benchmarks.multimodel)
        isl, osl = _at_least(self._isl.predict(), self._observed_isl), _at_least(self._osl.predict(),
                                                                                 self._observed_osl)
        needs: dict[str, float] = {}
        for pool in self.pools:
            if rate <= 0 or isl is None or osl is None:
                needs[pool] = 0.0
                continue
            prefill = decode = 0.0
            if pool in ("prefill", "both"):
                capacity = profile.prefill_capacity_tokens_per_s(isl, config.ttft_target_s)
                prefill = rate * isl / capacity if capacity > 0 else math.inf
            if pool in ("decode", "both"):
                capacity = profile.decode_capacity_tokens_per_s(isl + osl / 2, config.itl_target_s)
                decode = rate * osl / capacity if capacity > 0 else math.inf
            needs[pool] = (prefill + decode) * self.corrections[pool]
        return needs

    def _rising(self) -> bool:
        """Whether a rise is due its spare: the rate predictor's prediction at the horizon is over its level
        now by more than `rise_threshold`, and that rate alone fills `rise_min_need` of a prefill worker at
        the usual ISL (not the window's, which one long prompt can make a trickle's need read high)."""
        assert self.profile is not None
        config = self.config
        level, usual_isl = self._rate.predict(0.0), self._usual_isl.predict()
        ahead = self._rate.predict(self.horizon_s / config.interval_s)
        if level is None or ahead is None or usual_isl is None or ahead <= level * (1 + config.rise_threshold):
            return False
        capacity = self.profile.prefill_capacity_tokens_per_s(usual_isl, config.ttft_target_s)
        return capacity > 0 and ahead * usual_isl / capacity >= config.rise_min_need

    def _sla_targets(self, current: Mapping[str, int], needs: Mapping[str, float], *, rising: bool = False
                     ) -> tuple[dict[str, int], dict[str, str]]:
        config = self.config
        targets: dict[str, int] = {}
        reasons: dict[str, str] = {}
        for pool in self.pools:
            now, need = current[pool], needs[pool]
            spare = rising and pool in ("prefill", "both")
            wanted = config.max_of(pool) if math.isinf(need) else min(_wanted(need, config, rise=spare),
                                                                      config.max_of(pool))
            if wanted > now:
                self._lower_since[pool] = None
                targets[pool], reasons[pool] = min(wanted, now + config.max_step_up), "sla_up"
                continue
            # one worker fewer still carries the need with `down_margin` to spare (and a rise's spare is kept)
            fits_fewer = (now > 0 and not math.isinf(need) and need <= (now - 1) * (1 - config.down_margin)
                          and wanted < now)
            targets[pool], reasons[pool] = self._maybe_down(pool, now, fits_fewer, max(wanted, 0), "sla_down")
        return targets, reasons

    def _correct(self, observation: Observation) -> None:
        """Move each pool's correction toward observed / expected latency at the load it carries now."""
        assert self.profile is not None
        profile, config = self.profile, self.config
        rate, isl, osl = observation.request_rate_per_s, observation.mean_isl, observation.mean_osl
        if not (math.isfinite(rate) and rate > 0 and math.isfinite(isl) and math.isfinite(osl)):
            return
        low, high = config.correction_bounds
        for pool in self.pools:
            seen = observation.pools.get(pool)
            if seen is None or seen.num_workers <= 0:
                continue
            ratios = []
            if pool in ("prefill", "both") and math.isfinite(seen.ttft_s):
                expected = profile.expected_ttft_s(isl, rate * isl / seen.num_workers)
                if math.isfinite(expected) and expected > 0:
                    ratios.append(seen.ttft_s / expected)
            if pool in ("decode", "both") and math.isfinite(seen.itl_s) and seen.num_running > 0:
                expected = profile.expected_itl_s(isl + osl / 2, seen.num_running / seen.num_workers)
                if math.isfinite(expected) and expected > 0:
                    ratios.append(seen.itl_s / expected)
            if ratios:
                ratio = min(high, max(low, max(ratios)))
                alpha = config.correction_alpha
                self.corrections[pool] = alpha * ratio + (1 - alpha) * self.corrections[pool]

    # ---- load mode ---------------------------------------------------------------------------------------

    def _load_targets(self, current: Mapping[str, int], observation: Observation
                      ) -> tuple[dict[str, int], dict[str, str]]:
        config = self.config
        targets: dict[str, int] = {}
        reasons: dict[str, str] = {}
        for pool in self.pools:
            now = current[pool]
            seen = observation.pools.get(pool, PoolObservation(num_workers=now))
            latencies = []  # observed / target of each signal this pool answers for
            if pool in ("prefill", "both"):
                latencies.append(seen.ttft_s / config.ttft_target_s)
            if pool in ("decode", "both"):
                latencies.append(seen.itl_s / config.itl_target_s)
            known = [x for x in latencies if math.isfinite(x)]
            queue_per_worker = seen.num_waiting / max(1, seen.num_workers)
            if seen.num_starting > 0:  # the last growth is still arriving: judge the pool once it serves
                targets[pool], reasons[pool] = now, "hold"
                continue
            if (known and max(known) > 1) or queue_per_worker > config.load_queue_per_worker:
                self._lower_since[pool] = None
                grown = min(config.max_of(pool), now + config.max_step_up)
                targets[pool], reasons[pool] = (grown, "load_up") if grown > now else (now, "hold")
                continue
            comfortable = seen.num_waiting == 0 and all(x < config.load_headroom for x in known)
            targets[pool], reasons[pool] = self._maybe_down(pool, now, comfortable and now > 0,
                                                            now - config.max_step_down, "load_down")
        return targets, reasons

    # ---- shared ------------------------------------------------------------------------------------------

    def _maybe_down(self, pool: str, now: int, lower: bool, to: int, reason: str) -> tuple[int, str]:
        """Shrink `pool` toward `to` (by `max_step_down` at most) once every decision of the last
        `down_delay_s` saw a lower need (the first one counting its interval); else hold."""
        config = self.config
        if not lower:
            self._lower_since[pool] = None
            return min(now, config.max_of(pool)), "hold" if now <= config.max_of(pool) else "bound"
        if self._yielding:  # another model waits for workers: what this pool does not need goes now
            self._lower_since[pool] = None
            return max(to, 0), "yield"
        since = self._lower_since[pool]
        if since is None:
            since = self._lower_since[pool] = self._now_s
        delay_s = 3 * config.interval_s if config.down_delay_s is None else config.down_delay_s
        if self._now_s - since + config.interval_s < delay_s - 1e-9:
            return now, "hold"
        self._lower_since[pool] = None
        return max(to, now - config.max_step_down, 0), reason

    def _apply_budget(self, targets: dict[str, int], reasons: dict[str, str], needs: Mapping[str, float], *,
                      keep_serving: bool) -> None:
        """Trim the planned pools until the total fits `max_total_workers` and the shared budget's allowance:
        each time the pool with the most workers per unit of need (the most to spare) gives one, never below its min nor, while the fleet
        serves (`keep_serving`), a serving pool below one worker: overrides and floors that alone exceed the
        budget hold."""
        budget = self.config.max_total_workers
        if self.budget is not None:
            allowance = self.budget.allowance(self.member)
            budget = allowance if budget is None else min(budget, allowance)
        if budget is None:
            return

        def floor(pool: str) -> int:
            serving = 1 if keep_serving and pool in _SERVING else 0
            return max(serving, self.config.min_of(pool)) if keep_serving else 0

        while sum(targets.values()) > budget:
            candidates = [p for p in self.pools if p not in self._overrides and targets[p] > floor(p)]
            if not candidates:
                return
            pool = max(candidates, key=lambda p: targets[p] / max(needs.get(p, 0.0), 1e-9)
                       if math.isfinite(needs.get(p, NAN)) else targets[p])
            targets[pool] -= 1
            reasons[pool] = "budget"


def _wanted(need: float, config: PlannerConfig, *, rise: bool) -> int:
    """The whole workers a finite `need` asks for, with `rise_spare_workers` more on a rise (`rise`) where the
    need is at least `rise_min_need`."""
    wanted = math.ceil(need - 1e-9)
    if rise and need >= config.rise_min_need:
        wanted += config.rise_spare_workers
    return wanted


def _at_least(predicted: float | None, observed: float) -> float | None:
    """The larger of a prediction and an observation; either may be missing (None, NaN)."""
    if not math.isfinite(observed):
        return predicted
    return observed if predicted is None else max(predicted, observed)


def _or_nan(value: float | None) -> float:
    return NAN if value is None else value
