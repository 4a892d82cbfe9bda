"""Capacity profiles: what one worker of a deployment can do, measured, and the capacity math on top of it.

A `CapacityProfile` is data (JSON, written by `dynctl profile`): measured prefill points (ISL -> TTFT of one
request alone on an idle worker, and the prompt tokens/s the worker sustains saturated with that ISL) and
decode points ((context, batch size) -> mean inter-token latency, i.e. the decode step time), plus the
limits the worker ran with. Its methods answer the planner's questions, as pure functions of that data:

- how many prompt tokens/s one prefill worker serves while keeping TTFT under a target
  (`prefill_capacity_tokens_per_s`), and how many output tokens/s one decode worker serves while keeping
  ITL under a target (`decode_capacity_tokens_per_s`);
- what TTFT and ITL the profile expects at a given load (`expected_ttft_s`, `expected_itl_s`), which the
  planner divides observed values by to correct for a fleet faster or slower than its profile.

Between measured points every curve is piecewise linear. Outside them:
- below the smallest measured ISL, context or batch size a curve holds its first value (a smaller job is
  never priced cheaper than the smallest one measured: conservative for times);
- above the largest, times (TTFT, ITL) extend their last segment linearly, never below the last measured
  value (more work never takes less time), while throughputs (saturated tokens/s) hold their last value.
Beyond the measured range a profile is an estimate; measure the ISLs and contexts you serve.

Shipped profiles live in `profiles/<name>.json` next to this module (`shipped`, `shipped_names`).

Invariants: a profile has at least one prefill and one decode point; points are strictly increasing (ISL;
context, then batch size) with positive times and throughputs; profiles are immutable. Nothing here does
I/O except `load`, `save` and `shipped`.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import msgspec

from dynserve.errors import InvalidRequestError

__all__ = ["CapacityProfile", "DecodePoint", "PrefillPoint", "load", "shipped", "shipped_names"]

_SHIPPED_PACKAGE = "dynserve.planner"
_SHIPPED_DIR = "profiles"


class PrefillPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Prefill at one input sequence length: `ttft_s`, the time to first token of one request alone on an
    idle worker; `tokens_per_s`, the prompt tokens/s the worker sustains saturated with such requests."""

    isl: int
    ttft_s: float
    tokens_per_s: float


class DecodePoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decode with `batch_size` sequences of about `context` tokens each: `itl_s`, the mean step time."""

    context: int
    batch_size: int
    itl_s: float


class CapacityProfile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One worker's measured capacity (see the module docstring). `source` says how it was made (the command,
    the engine or mocker profile, the machine); `created` is an ISO date."""

    name: str
    source: str
    created: str
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    num_kv_blocks: int
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]

    def __post_init__(self) -> None:
        limits = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks")
        for field in limits:
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be at least 1")
        if not self.prefill or not self.decode:
            raise ValueError("a profile needs at least one prefill and one decode point")
        for p in self.prefill:
            if p.isl < 1 or not (p.ttft_s > 0 and p.tokens_per_s > 0):
                raise ValueError(f"prefill point {p}: isl, ttft_s and tokens_per_s must be positive")
        for d in self.decode:
            if d.context < 1 or d.batch_size < 1 or not d.itl_s > 0:
                raise ValueError(f"decode point {d}: context, batch_size and itl_s must be positive")
        isls = [p.isl for p in self.prefill]
        if any(a >= b for a, b in itertools.pairwise(isls)):
            raise ValueError("prefill points must have strictly increasing isl")
        keys = [(d.context, d.batch_size) for d in self.decode]
        if any(a >= b for a, b in itertools.pairwise(keys)):
            raise ValueError("decode points must be strictly increasing by (context, batch_size)")

    # ---- prefill --------------------------------------------------------------------------------------

    def ttft_alone_s(self, isl: float) -> float:
        """Time to first token of one request of `isl` prompt tokens alone on an idle worker."""
        return _interpolate([(p.isl, p.ttft_s) for p in self.prefill], isl, extend=True)

    def prefill_tokens_per_s(self, isl: float) -> float:
        """Prompt tokens/s one worker sustains saturated with requests of `isl` tokens."""
        return _interpolate([(p.isl, p.tokens_per_s) for p in self.prefill], isl, extend=False)

    def prefill_capacity_tokens_per_s(self, isl: float, ttft_target_s: float) -> float:
        """Prompt tokens/s one worker sustains while its mean TTFT stays within `ttft_target_s`.

        The worker is modelled as an M/D/1 queue (Poisson arrivals, one server, deterministic service): the
        service time S is `ttft_alone_s(isl)` and the utilisation rho is the offered load over
        `prefill_tokens_per_s(isl)`, so the mean TTFT is S * (1 + rho / (2 * (1 - rho))). With k = target / S
        the largest rho meeting the target is 2(k - 1) / (2k - 1), and the capacity is rho times the
        saturated throughput; 0 when S alone misses the target (k <= 1).
        """
        service_s = self.ttft_alone_s(isl)
        k = ttft_target_s / service_s
        if k <= 1.0:
            return 0.0
        rho = 2.0 * (k - 1.0) / (2.0 * k - 1.0)
        return rho * self.prefill_tokens_per_s(isl)

    def expected_ttft_s(self, isl: float, load_tokens_per_s: float) -> float:
        """The mean TTFT the M/D/1 model of `prefill_capacity_tokens_per_s` expects for requests of `isl`
        tokens on one worker offered `load_tokens_per_s` prompt tokens/s; inf at or above saturation."""
        if load_tokens_per_s < 0:
            raise ValueError("load_tokens_per_s must be >= 0")
        rho = load_tokens_per_s / self.prefill_tokens_per_s(isl)
        if rho >= 1.0:
            return math.inf
        return self.ttft_alone_s(isl) * (1.0 + rho / (2.0 * (1.0 - rho)))

    # ---- decode ---------------------------------------------------------------------------------------

    def itl_s(self, context: float, batch_size: float) -> float:
        """Mean inter-token latency (decode step time) with `batch_size` sequences of `context` tokens:
        each measured context's curve over batch size, then linearly between the two nearest contexts."""
        contexts = self._contexts()
        values = [(c, self._itl_at_context(c, batch_size)) for c in contexts]
        return _interpolate(values, context, extend=True)

    def expected_itl_s(self, context: float, batch_size: float) -> float:
        """The ITL the profile expects with `batch_size` sequences (a fleet's mean, possibly fractional) of
        `context` tokens decoding on one worker; the planner divides the observed ITL by it."""
        return self.itl_s(context, batch_size)

    def max_decode_batch(self, context: float) -> int:
        """The most sequences of `context` tokens one worker decodes at once: `max_num_seqs`, or fewer when
        their KV blocks do not fit in the cache."""
        blocks_per_seq = max(1, math.ceil(context / self.block_size))
        return min(self.max_num_seqs, self.num_kv_blocks // blocks_per_seq)

    def decode_capacity_tokens_per_s(self, context: float, itl_target_s: float) -> float:
        """Output tokens/s one worker serves while its ITL stays within `itl_target_s`, decoding sequences of
        `context` tokens: the batch size b (fractional, by interpolation) up to the first one whose ITL
        reaches the target, capped at `max_decode_batch`, gives b / itl_s(context, b); the best such rate
        at or below that batch size is returned, so capacity never falls as the target loosens. 0 when even
        one sequence misses the target or does not fit."""
        limit = self.max_decode_batch(context)
        if limit < 1 or self.itl_s(context, 1) > itl_target_s:
            return 0.0
        measured = (float(d.batch_size) for d in self.decode if d.batch_size < limit)
        points = sorted({1.0, float(limit), *measured})
        best = 1.0 / self.itl_s(context, 1)
        for low, high in itertools.pairwise(points):
            itl_high = self.itl_s(context, high)
            if itl_high > itl_target_s:  # the target is crossed in (low, high]: solve on the segment
                itl_low = self.itl_s(context, low)
                b = low + (high - low) * (itl_target_s - itl_low) / (itl_high - itl_low)
                return max(best, b / self.itl_s(context, b))
            best = max(best, high / itl_high)
        return best

    def _contexts(self) -> list[int]:
        return sorted({d.context for d in self.decode})

    def _itl_at_context(self, context: int, batch_size: float) -> float:
        curve = [(d.batch_size, d.itl_s) for d in self.decode if d.context == context]
        return _interpolate(curve, batch_size, extend=True)

    # ---- files ----------------------------------------------------------------------------------------

    def save(self, path: str | Path) -> None:
        """Write the profile as indented JSON."""
        Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(self), indent=2) + b"\n")


def load(path: str | Path) -> CapacityProfile:
    """The profile in the JSON file at `path`; InvalidRequestError says what is wrong with it."""
    where = f"capacity profile {str(path)!r}"
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {where}: {exc}", param="profile") from None
    try:
        return msgspec.json.decode(data, type=CapacityProfile)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"{where} is invalid: {exc}", param="profile") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequestError(f"{where} is not JSON: {exc}", param="profile") from None


def shipped_names() -> list[str]:
    """Names of the profiles shipped with dynserve, sorted."""
    folder = resources.files(_SHIPPED_PACKAGE) / _SHIPPED_DIR
    return sorted(f.name.removesuffix(".json") for f in folder.iterdir() if f.name.endswith(".json"))


def shipped(name: str) -> CapacityProfile:
    """The shipped profile `name`; InvalidRequestError lists the shipped names when there is none."""
    if name not in shipped_names():
        raise InvalidRequestError(f"no shipped capacity profile {name!r}; shipped: "
                                  f"{', '.join(shipped_names())}", param="profile")
    with resources.as_file(resources.files(_SHIPPED_PACKAGE) / _SHIPPED_DIR / f"{name}.json") as path:
        return load(path)


def _interpolate(points: Sequence[tuple[float, float]], x: float, *, extend: bool) -> float:
    """y at `x` on the piecewise-linear curve through `points` (sorted by x, at least one): the first y
    below the first point; above the last, the last segment extended but never below the last y when
    `extend` (times), else the last y (throughputs)."""
    xs = [p[0] for p in points]
    if x <= xs[0]:
        return points[0][1]
    if x >= xs[-1]:
        (x0, y0), (x1, y1) = points[-2] if len(points) > 1 else points[-1], points[-1]
        if not extend or x1 == x0:
            return y1
        return max(y1, y1 + (y1 - y0) * (x - x1) / (x1 - x0))
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
