"""`dynctl profile`: measure one worker's engine in this process (no Ray) and write its capacity profile
(`dynserve.planner.profile.CapacityProfile`, JSON), the data the planner scales the pools by.

    dynctl profile --mocker llama-3.1-8b-h100 --output 8b.json          (a mocker's hardware profile)
    dynctl profile --model path/to/model --device cuda --output me.json  (a real model, on this machine)

What it measures, through the engine's ordinary `add_request` / `step` surface:
- prefill, per ISL: TTFT of one request alone on the idle engine (max_tokens=1; the median of a few runs),
  and the prompt tokens/s the engine sustains when enough such requests are queued to fill its per-step
  token budget for several steps;
- decode, per (context, batch size): `batch_size` requests of `context` prompt tokens are started and
  stepped until each has its first token; then the mean wall time of the next decode-only steps is the
  ITL. During those steps each sequence holds between `context` and `context` plus a few dozen tokens.
  Points whose sequences do not fit in the KV cache or the context limit are skipped.
Every request has its own random token ids, and the prefix cache is reset between points, so no prompt is
served from the cache.

A mocker runs `mocker_speedup` times faster than its profile; measured wall times are multiplied back by
it, so the profile is in the modelled hardware's seconds. The engine's own Python work around a step is
multiplied too, so the default speedup is the largest, up to 100, at which the profile's shortest step still
lasts 10 ms of wall time (at least 1), against which that work is a few percent. A run where the wall time
exceeded the modelled time by over 5% (that work, or a busy machine) is tried again, up to 3 times, keeping
the least disturbed; a point still over is flagged in its progress line. The unmeasured warm-up of a
decode point (prefilling its batch) runs at a much higher speedup.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from dynserve.cli.options import EXIT_OK, add_settings_group, settings_from
from dynserve.config import Settings
from dynserve.errors import InvalidRequestError
from dynserve.planner.profile import CapacityProfile, DecodePoint, PrefillPoint
from dynserve.protocol import SamplingParams

if TYPE_CHECKING:  # the engine loads with the command, not with dynctl's parser
    from dynserve.engine.core import EngineCore

__all__ = ["PointPlan", "add_profile_arguments", "measure", "profile"]

_MAX_SPEEDUP = 100.0
_MIN_STEP_WALL_MS = 10.0  # the default speedup keeps the profile's shortest step at least this long
_WARMUP_SPEEDUP_FACTOR = 1000.0  # unmeasured warm-up steps of a mocker run this much faster again
_IDLE_GAP_S = 0.01  # an idle gap before a timed run: a mocker's clock starts afresh (over its 5 ms catch-up)
_MAX_DECODE_STEPS_FACTOR = 8  # a decode point times at most this many times its minimum steps
_OVERHEAD_TOLERANCE = 1.05  # wall time this far over the modelled time means the engine's own work showed
_MAX_TRIES = 3  # runs of a point that showed it, at most


@dataclasses.dataclass(frozen=True, slots=True)
class PointPlan:
    """What to measure: prefill ISLs, decode contexts and batch sizes; TTFT runs per ISL (median taken),
    token-budget steps per saturated prefill run; decode points time at least `num_decode_steps` steps
    and at least `decode_window_s` of wall time (so a hiccup of the machine weighs little)."""

    isls: tuple[int, ...]
    contexts: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    num_ttft_runs: int = 3
    num_saturated_steps: int = 4
    num_decode_steps: int = 8
    decode_window_s: float = 0.25

    @classmethod
    def default(cls, max_num_seqs: int, *, quick: bool) -> PointPlan:
        """ISLs 128..8192 (powers of 2), contexts 512, 2048, 8192, batch sizes powers of 2 up to
        `max_num_seqs` (and it); `quick`: about half the points, one TTFT run, shorter runs."""
        ratio = 4 if quick else 2
        batch_sizes = sorted({*_powers(ratio, max_num_seqs), max_num_seqs})
        if quick:
            return cls((128, 1024, 8192), (512, 2048), tuple(batch_sizes), 1, 2, 4, 0.05)
        return cls(tuple(_powers(2, 8192, start=128)), (512, 2048, 8192), tuple(batch_sizes))


def _powers(ratio: int, limit: int, start: int = 1) -> list[int]:
    values = [start]
    while values[-1] * ratio <= limit:
        values.append(values[-1] * ratio)
    return values


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    """`dynctl profile`'s flags: the engine's and the mocker's settings, and what to measure."""
    parser.description = ("Measure one worker's engine in this process (a mocker profile with --mocker, else "
                          "the model) and write the capacity profile the planner scales by.")
    parser.add_argument("--output", required=True, metavar="PATH", help="where to write the profile (JSON)")
    parser.add_argument("--name", default=None, help="the profile's name [default: the mocker profile's, or "
                        "<model id>-<device>]")
    parser.add_argument("--quick", action="store_true", help="fewer points and shorter runs")
    parser.add_argument("--worker-url", default=None, metavar="SPEC",
                        help="measure a running OpenAI server through its API instead (a vLLM worker: "
                        "'vllm=http://HOST:PORT'; see dynctl gateway --worker-url)")
    parser.add_argument("--isl", type=_int_list, default=None, metavar="N,N,...",
                        help="prefill ISLs [default: 128,256,...,8192; --quick 128,1024,8192; those that "
                        "fit]")
    parser.add_argument("--context", type=_int_list, default=None, metavar="N,N,...",
                        help="decode contexts [default: 512,2048,8192; --quick 512,2048; those that fit]")
    parser.add_argument("--batch", type=_int_list, default=None, metavar="N,N,...",
                        help="decode batch sizes [default: 1,2,4,... up to max_num_seqs; --quick 1,4,16,...]")
    add_settings_group(parser, "mocker")
    add_settings_group(parser, "engine")
    parser.epilog = (f"--mocker-speedup defaults to the largest speedup up to {_MAX_SPEEDUP:g} at which the "
                     f"mocker profile's shortest step lasts {_MIN_STEP_WALL_MS:g} ms of wall time (at least "
                     "1): faster, the engine's own Python work would inflate the measured times.")


def profile(args: argparse.Namespace) -> int:
    """Build the engine `args` describe, measure it, write the profile to `args.output`."""
    settings = settings_from(args)
    if args.worker_url is not None:
        return _profile_server(args, settings)
    engine, mocker_speedup, name, machine = _build_engine(settings)
    plan = PointPlan.default(engine.scheduler.max_num_seqs, quick=args.quick)
    plan = dataclasses.replace(plan, isls=args.isl or plan.isls, contexts=args.context or plan.contexts,
                               batch_sizes=args.batch or plan.batch_sizes)

    def progress(line: str) -> None:
        print(f"profile: {line}", file=sys.stderr, flush=True)

    prefill, decode = measure(engine, plan, mocker_speedup=mocker_speedup, progress=progress)
    result = CapacityProfile(
        name=args.name or name, source=f"{machine}: {_command(args, settings)}",
        created=datetime.datetime.now(datetime.UTC).date().isoformat(),
        block_size=engine.block_manager.block_size, max_num_seqs=engine.scheduler.max_num_seqs,
        max_num_batched_tokens=engine.scheduler.max_num_batched_tokens, max_model_len=engine.max_model_len,
        num_kv_blocks=engine.block_manager.num_blocks, prefill=tuple(prefill), decode=tuple(decode))
    result.save(args.output)
    print(f"dynctl profile: wrote {result.name!r} ({len(prefill)} prefill and {len(decode)} decode points) "
          f"to {args.output}")
    return EXIT_OK


def _profile_server(args: argparse.Namespace, settings: Settings) -> int:
    """`dynctl profile --worker-url`: measure the server through its API (`profile_server.py`)."""
    import asyncio

    from dynserve.cli.profile_server import measure_server
    from dynserve.workers.attached import describe_server, parse_worker_url

    spec = parse_worker_url(args.worker_url)
    info = asyncio.run(describe_server(spec, worker_id="profiled", block_size=settings.block_size,
                                       max_model_len=settings.max_model_len))
    plan = PointPlan.default(settings.max_num_seqs, quick=args.quick)

    def progress(line: str) -> None:
        print(f"profile: {line}", file=sys.stderr, flush=True)

    prefill, decode = asyncio.run(measure_server(
        info, spec.url, isls=args.isl or plan.isls, contexts=args.context or plan.contexts,
        batch_sizes=args.batch or plan.batch_sizes, num_ttft_runs=plan.num_ttft_runs,
        num_decode_tokens=16 if args.quick else 48, progress=progress))
    if not prefill or not decode:
        raise InvalidRequestError("no prefill or no decode point fits this server: choose smaller --isl, "
                                  "--context or --batch", param="isl" if not prefill else "context")
    result = CapacityProfile(
        name=args.name or f"{info.model_id}-{spec.engine}".replace("/", "-").lower(),
        source=f"{spec.engine} server at {spec.url}, measured over HTTP: {_command(args, settings)}",
        created=datetime.datetime.now(datetime.UTC).date().isoformat(), block_size=info.block_size,
        max_num_seqs=settings.max_num_seqs, max_num_batched_tokens=settings.max_num_batched_tokens,
        max_model_len=info.max_model_len, num_kv_blocks=max(1, info.num_blocks), prefill=tuple(prefill),
        decode=tuple(decode))
    result.save(args.output)
    print(f"dynctl profile: wrote {result.name!r} ({len(prefill)} prefill and {len(decode)} decode points) "
          f"to {args.output}")
    return EXIT_OK


def _build_engine(settings: Settings) -> tuple[EngineCore, float | None, str, str]:
    """(engine, its speedup if a mocker, default name, what is measured): a sleeping mocker, or the model."""
    if settings.mocker is not None:
        from dynserve.workers.mocker import MockEngine
        from dynserve.workers.mocker_profiles import get_profile

        hardware = get_profile(settings.mocker)
        speedup = settings.mocker_speedup
        if "mocker_speedup" not in settings.model_fields_set:
            shortest_step_ms = min(hardware.prefill_fixed_ms, hardware.decode_fixed_ms)
            speedup = float(f"{max(1.0, min(_MAX_SPEEDUP, shortest_step_ms / _MIN_STEP_WALL_MS)):.2g}")
        engine = MockEngine(settings.model_copy(update={"mocker_speedup": speedup}), sleep=True)
        return engine, speedup, hardware.name, f"mocker profile {hardware.name}, speedup {speedup:g}"
    from dynserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(settings)
    device = str(engine.device)
    if device.startswith("cuda"):
        import torch

        where = torch.cuda.get_device_name(engine.device)
    else:
        where = f"{platform.machine()} CPU, {os.cpu_count()} cores"
    name = f"{engine.model_id}-{device.split(':')[0]}".replace("/", "-").lower()
    return engine, None, name, f"model {engine.model_id} ({str(engine.dtype).removeprefix('torch.')}) on {where} ({platform.node()})"


def _command(args: argparse.Namespace, settings: Settings) -> str:
    """The `dynctl profile` command line equivalent to `args` (settings from the environment as flags)."""
    words = ["dynctl", "profile"]
    for field in sorted(settings.model_fields_set):
        value = getattr(settings, field)
        flag = "--" + field.replace("_", "-")
        if isinstance(value, bool):
            words.append(flag if value else "--no-" + flag[2:])
        else:
            words += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
    for flag in ("isl", "context", "batch"):
        if getattr(args, flag):
            words += [f"--{flag}", ",".join(map(str, getattr(args, flag)))]
    words += ["--quick"] * args.quick + (["--name", args.name] if args.name else [])
    words += ["--worker-url", args.worker_url] if args.worker_url else []
    words += ["--output", args.output]
    return " ".join(words)


# ---- measuring ----------------------------------------------------------------------------------------

def measure(
    engine: EngineCore, plan: PointPlan, *, mocker_speedup: float | None = None,
    progress: Callable[[str], None] = lambda _line: None,
) -> tuple[list[PrefillPoint], list[DecodePoint]]:
    """The prefill and decode points of `plan` that fit `engine`, in wall seconds (times `mocker_speedup`
    for a `MockEngine` running at that speedup); one progress line per point (skipped ones say why).

    More work never takes less time: a TTFT measured below the previous ISL's, or an ITL below the previous
    batch size's at the same context (noise, where the difference is smaller than it), is raised to that
    value, and its progress line says so."""
    bench = _Bench(engine, mocker_speedup)
    bench.ttft_alone_s(min(64, engine.max_model_len - 1))  # warm-up: first-use costs stay out of the points
    prefill = _measure_prefill(bench, plan, progress)
    decode = [point for context in plan.contexts for point in _measure_decode(bench, plan, context, progress)]
    if not prefill or not decode:
        raise InvalidRequestError("no prefill or no decode point fits this engine: choose smaller --isl, "
                                  "--context or --batch", param="isl" if not prefill else "context")
    return prefill, decode


def _measure_prefill(bench: _Bench, plan: PointPlan, progress: Callable[[str], None]) -> list[PrefillPoint]:
    points: list[PrefillPoint] = []
    for isl in plan.isls:
        why_not = bench.why_not_fits(1, isl, 1)
        if why_not:
            progress(f"prefill isl={isl}: skipped ({why_not})")
            continue
        alone = functools.partial(bench.ttft_alone_s, isl)
        runs = [_least_disturbed(alone) for _ in range(plan.num_ttft_runs)]
        ttft_s = _round(statistics.median(value for value, _flag in runs))
        saturated = functools.partial(bench.saturated_tokens_per_s, isl, plan.num_saturated_steps)
        tokens_per_s, flag = _least_disturbed(saturated, higher_is_better=True)
        flag = flag or next((f for _value, f in runs if f), "")
        if points and ttft_s < points[-1].ttft_s:
            flag += f" (measured {ttft_s:.4g} s, below isl={points[-1].isl}'s: raised to it)"
            ttft_s = points[-1].ttft_s
        points.append(PrefillPoint(isl=isl, ttft_s=ttft_s, tokens_per_s=_round(tokens_per_s)))
        progress(f"prefill isl={isl}: ttft {ttft_s:.4g} s alone, {tokens_per_s:,.0f} tokens/s "
                 f"saturated{flag}")
    return points


def _measure_decode(bench: _Bench, plan: PointPlan, context: int,
                    progress: Callable[[str], None]) -> list[DecodePoint]:
    points: list[DecodePoint] = []
    for batch_size in plan.batch_sizes:
        itl_s, note = _least_disturbed(functools.partial(
            bench.itl_s, context, batch_size, plan.num_decode_steps, plan.decode_window_s))
        if itl_s is None:
            progress(f"decode context={context} batch={batch_size}: skipped ({note})")
            continue
        itl_s = _round(itl_s)
        if points and itl_s < points[-1].itl_s:
            note += f" (measured {itl_s * 1e3:.4g} ms, below batch={points[-1].batch_size}'s: raised to it)"
            itl_s = points[-1].itl_s
        points.append(DecodePoint(context=context, batch_size=batch_size, itl_s=itl_s))
        progress(f"decode context={context} batch={batch_size}: itl {itl_s * 1e3:.4g} ms{note}")
    return points


def _least_disturbed(run: Callable[[], tuple[Any, str]], *,
                     higher_is_better: bool = False) -> tuple[Any, str]:
    """`run()`'s (value, note); a run flagged as disturbed (a mocker that fell behind its modelled time:
    the machine was busy) is tried again, `_MAX_TRIES` times at most, keeping the least disturbed value."""
    best: tuple[Any, str] | None = None
    for _ in range(_MAX_TRIES):
        value, note = run()
        if value is None or not note:
            return value, note
        if best is None or (value > best[0] if higher_is_better else value < best[0]):
            best = (value, note)
    assert best is not None
    return best


def _round(value: float) -> float:
    """4 significant digits: finer than a measurement's noise."""
    return float(f"{value:.4g}")


class _Bench:
    """Timed runs on one engine. Each run leaves the engine idle with an empty prefix cache."""

    def __init__(self, engine: EngineCore, mocker_speedup: float | None) -> None:
        self.engine = engine
        self.time_scale = mocker_speedup or 1.0
        self._mocker_speedup = mocker_speedup
        self._rng = random.Random(0)
        self._ids = 0

    def why_not_fits(self, batch_size: int, context: int, max_tokens: int) -> str:
        """Why `batch_size` sequences of `context` prompt tokens growing by `max_tokens` cannot run together
        without preemption; "" when they can."""
        engine = self.engine
        if context + max_tokens > engine.max_model_len:
            return f"{context + max_tokens} tokens exceed the context limit {engine.max_model_len}"
        if batch_size > engine.scheduler.max_num_seqs:
            return f"over max_num_seqs {engine.scheduler.max_num_seqs}"
        blocks = engine.block_manager
        needed = batch_size * blocks.blocks_needed(context + max_tokens)
        usable = blocks.num_blocks - engine.scheduler.num_reserved_blocks
        return f"needs {needed} KV blocks, the cache has {usable}" if needed > usable else ""

    def ttft_alone_s(self, isl: int) -> tuple[float, str]:
        """(TTFT of one request of `isl` tokens on the idle engine, a flag for the progress line)."""
        prompt = self._prompt(isl)

        def first_token() -> None:
            request_id = self._add(prompt, 1)
            while not any(d.request_id == request_id for d in self._step()):
                pass

        elapsed_s, flag = self._timed(first_token)
        return self._done(elapsed_s), flag

    def saturated_tokens_per_s(self, isl: int, num_steps: int) -> tuple[float, str]:
        budget = self.engine.scheduler.max_num_batched_tokens
        num_requests = max(2, math.ceil(num_steps * budget / isl))
        for _ in range(num_requests):
            self._add(self._prompt(isl), 1)
        engine = self.engine
        elapsed_s, flag = self._timed(lambda: self._run_until(lambda: not engine.has_unfinished_requests()))
        return self._done(num_requests * isl / elapsed_s), flag

    def itl_s(self, context: int, batch_size: int, min_steps: int,
              window_s: float) -> tuple[float | None, str]:
        """(ITL, a flag for the progress line), or (None, why the point was skipped). The timed steps last
        `window_s` of wall time: at least `min_steps`, at most `_MAX_DECODE_STEPS_FACTOR` times that."""
        engine = self.engine
        budget = engine.scheduler.max_num_batched_tokens
        # the steps until every sequence has its first token bound what the earliest ones decode meanwhile
        num_prompt_tokens = batch_size * context
        num_warmup_steps = (math.ceil(num_prompt_tokens / (budget - batch_size)) if budget > batch_size
                            else num_prompt_tokens) + 1
        max_steps = _MAX_DECODE_STEPS_FACTOR * min_steps
        max_tokens = num_warmup_steps + max_steps + 2
        why_not = self.why_not_fits(batch_size, context, max_tokens)
        if why_not:
            return None, why_not
        request_ids = {self._add(self._prompt(context), max_tokens) for _ in range(batch_size)}
        started: set[str] = set()
        with self._fast_forward():
            while not started >= request_ids:
                started.update(d.request_id for d in self._step())
        step_start_s = time.perf_counter()
        self._step()  # one step at the measured pace: a mocker's clock catches up with the wall
        step_s = time.perf_counter() - step_start_s
        num_steps = max(min_steps, min(max_steps, math.ceil(window_s / max(step_s, 1e-6))))
        num_preemptions = engine.stats.num_preemptions
        num_decoded = 0

        def decode_steps() -> None:
            nonlocal num_decoded
            for _ in range(num_steps):
                self._step()
                stats = engine.stats
                num_decoded += stats.last_decode_tokens if stats.last_prefill_tokens == 0 else 0

        elapsed_s, flag = self._timed(decode_steps)
        for request_id in request_ids:
            engine.abort(request_id)
        self._done(0.0)
        if engine.stats.num_preemptions != num_preemptions or num_decoded != batch_size * num_steps:
            return None, "the batch did not decode together (preemption or unfinished prefill)"
        return elapsed_s / num_steps, flag

    # ---- helpers --------------------------------------------------------------------------------------

    def _prompt(self, num_tokens: int) -> list[int]:
        """Random token ids: no two prompts share a block, so none is served from the prefix cache."""
        return self._rng.choices(range(self.engine.vocab_size), k=num_tokens)

    def _add(self, prompt: list[int], max_tokens: int) -> str:
        self._ids += 1
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return self.engine.add_request(prompt, params, f"profile-{self._ids}")

    def _step(self) -> list[Any]:
        deltas = self.engine.step()
        assert not self.engine.stalled, "only leases and KV reads stall an engine; profiling makes neither"
        return deltas

    def _run_until(self, done: Callable[[], bool]) -> None:
        while not done():
            self._step()

    def _timed(self, run: Callable[[], None]) -> tuple[float, str]:
        """(wall seconds `run` took times the time scale, a flag when a mocker took longer than modelled)."""
        time.sleep(_IDLE_GAP_S)
        busy_s = getattr(self.engine, "simulated_busy_s", 0.0)
        start_s = time.perf_counter()
        run()
        elapsed_s = time.perf_counter() - start_s
        modelled_s = getattr(self.engine, "simulated_busy_s", 0.0) - busy_s
        if self._mocker_speedup is None or elapsed_s <= _OVERHEAD_TOLERANCE * modelled_s + 1e-3:
            return elapsed_s * self.time_scale, ""
        flag = (f" (took {elapsed_s / max(modelled_s, 1e-9):.2f}x its modelled time: the engine's own work "
                f"at speedup {self._mocker_speedup:g}, or a busy machine)")
        return elapsed_s * self.time_scale, flag

    @contextlib.contextmanager
    def _fast_forward(self) -> Iterator[None]:
        """Within it, a mocker's steps run `_WARMUP_SPEEDUP_FACTOR` times faster (unmeasured warm-up)."""
        speedup = self._mocker_speedup
        if speedup is not None:
            self.engine.speedup = speedup * _WARMUP_SPEEDUP_FACTOR  # type: ignore[attr-defined]
        try:
            yield
        finally:
            if speedup is not None:
                self.engine.speedup = speedup  # type: ignore[attr-defined]

    def _done(self, value: float) -> float:
        """End a run: the engine is idle; its prefix cache is emptied for the next."""
        assert not self.engine.has_unfinished_requests()
        self.engine.reset_prefix_cache()
        return value

