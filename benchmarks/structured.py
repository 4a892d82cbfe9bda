"""Structured output's cost and correctness on the real model: `json_schema` requests against unconstrained
requests of the same lengths, at 1 and 16 concurrent streams, in one run.

1. **Constrained**: one request per schema of the validity corpus (`benchmarks/_schema_corpus.py`: SchemaStore
   schemas vendored in check-jsonschema and our own, sent bounded), a chat prompt asking for the document,
   sampled at temperature 1 with a seed per request, run by the engine with `c` requests in flight at any
   time (a closed loop: a finished request's stream sends the next). Every answer is checked: it must end
   with "stop" (an answer cut by `max_tokens` is a failure) and parse and validate against the schema as
   published and as sent.
2. **Unconstrained**: the same prompts, seeds and schedule, without the grammar, each request generating
   exactly the number of tokens its constrained answer had (`max_tokens` = that length, `ignore_eos`), so
   both runs decode the same tokens counts in the same batches.

Each pair runs `--repeats` times (3; `--quick` 1) and each side keeps its best pass: the one least disturbed
by other work on the machine. Reported per concurrency: TPOT (the median over requests of (last token time -
first token time) / (tokens - 1)) and throughput (generated tokens / wall time), both sides, every pass's
TPOT, and `tpot_ratio_c{c}` = constrained / unconstrained (1.0: structured output costs nothing). `validity`: valid answers / answers, over every
constrained answer of the run. `mask_p50_us`, `mask_p99_us`: the time to compute one constrained token's
allowed-token mask (`MaskTimings`, on the mask thread while the forward runs: a step's time over its rows),
over the measured passes.

Grammars are compiled in the warm-up (a worker keeps the 64 most recent), as a server that has seen the
schema before has them; the first request of a new schema also pays its compilation (1-50 ms) before its
prefill. The full run: c=16 over the whole corpus (44 schemas), c=1 over 6 of our own schemas
(`C1_SCHEMAS`); `--quick`: every fourth schema at c=16, 3 at c=1. The last stdout line is the JSON result; a copy goes to
`benchmarks/results/structured-<timestamp>.json`. Record runs in `docs/benchmarks.md`.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from benchmarks._common import git_commit, log, machine_info, percentile, write_result
from benchmarks._schema_corpus import Corpus, CorpusSchema, check_answer, load_corpus
from dynserve.config import Settings
from dynserve.engine.llm_engine import LLMEngine
from dynserve.engine.structured import GrammarState
from dynserve.model.resolve import default_model_path
from dynserve.protocol import Grammar, SamplingParams

MAX_TOKENS = 512
# the c=1 requests: our schemas with the shortest answers (25-45 tokens), so that c=1's passes, one token a
# step, take about as long as c=16's over the whole corpus
C1_SCHEMAS = ("own:enums", "own:tool_call", "own:sentiment", "own:person", "own:allof", "own:matrix")
NUM_C1_QUICK = 3


@dataclass(slots=True)
class Request:
    prompt_token_ids: list[int]
    params: SamplingParams
    schema: CorpusSchema | None = None


@dataclass(slots=True)
class Outcome:
    """One request's tokens, text, finish reason and the times its tokens came out (perf_counter)."""

    token_ids: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    token_times_s: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def tpot_s(self) -> float | None:
        times = self.token_times_s
        return (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None


def run_streams(engine: LLMEngine, requests: list[Request], concurrency: int) -> tuple[list[Outcome], float]:
    """Run `requests` in order, `concurrency` in flight at any time; (outcomes in request order, wall s)."""
    queue = collections.deque(enumerate(requests))
    in_flight: dict[str, int] = {}
    outcomes = [Outcome() for _ in requests]
    start_s = time.perf_counter()

    def admit() -> None:
        while queue and len(in_flight) < concurrency:
            i, request = queue.popleft()
            in_flight[engine.add_request(request.prompt_token_ids, request.params)] = i

    admit()
    while in_flight:
        deltas = engine.step()
        now_s = time.perf_counter()
        for delta in deltas:
            outcome = outcomes[in_flight[delta.request_id]]
            outcome.token_ids += delta.token_ids
            outcome.text.append(delta.text)
            outcome.token_times_s += [now_s] * len(delta.token_ids)
            if delta.finished:
                outcome.finish_reason = delta.finish_reason
                del in_flight[delta.request_id]
        admit()
    return outcomes, time.perf_counter() - start_s


def constrained_requests(engine: LLMEngine, schemas: list[CorpusSchema], seed: int) -> list[Request]:
    tokenizer = engine.tokenizer
    requests = []
    for i, schema in enumerate(schemas):
        title = schema.original.get("title") or schema.name.split(":", 1)[1]
        prompt = tokenizer.encode(tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write one JSON document for this schema: {title}."}]))
        grammar = Grammar(kind="json_schema", source=json.dumps(schema.sent))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed + i, grammar=grammar)
        requests.append(Request(prompt, params, schema))
    return requests


def same_lengths_unconstrained(requests: list[Request], outcomes: list[Outcome]) -> list[Request]:
    """Each request again without its grammar, generating exactly as many tokens as its answer had."""
    return [Request(r.prompt_token_ids, SamplingParams(max_tokens=len(o.token_ids), temperature=1.0,
                                                       seed=r.params.seed, ignore_eos=True))
            for r, o in zip(requests, outcomes, strict=True)]


def measure(engine: LLMEngine, requests: list[Request], concurrency: int, repeats: int) -> dict[str, Any]:
    """Constrained then unconstrained at `concurrency`, `repeats` times; the best TPOT and throughput of
    each (the passes least disturbed by other work on the machine), and every answer's check."""
    tpots: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    rates: dict[str, list[float]] = {"constrained": [], "unconstrained": []}
    invalid: dict[str, str] = {}
    lengths: list[int] = []
    for pass_index in range(repeats):
        constrained, constrained_s = run_streams(engine, requests, concurrency)
        free, free_s = run_streams(engine, same_lengths_unconstrained(requests, constrained), concurrency)
        lengths = [len(o.token_ids) for o in constrained]
        if [len(o.token_ids) for o in free] != lengths:
            raise RuntimeError(f"unconstrained lengths {[len(o.token_ids) for o in free]} differ from {lengths}")
        for kind, outcomes, wall_s in (("constrained", constrained, constrained_s), ("unconstrained", free, free_s)):
            tpots[kind].append(percentile([t for o in outcomes if (t := o.tpot_s) is not None], 50) or 0.0)
            rates[kind].append(sum(lengths) / wall_s)
        invalid.update({f"pass {pass_index}: {name}": problem for name, problem in _check(requests, constrained).items()})
    tpot_c, tpot_u = min(tpots["constrained"]), min(tpots["unconstrained"])
    return {"concurrency": concurrency, "num_requests": len(requests), "repeats": repeats,
            "num_tokens": sum(lengths), "answer_len_p50_max": [percentile([float(n) for n in lengths], 50), max(lengths)],
            "tpot_constrained_ms": 1e3 * tpot_c, "tpot_unconstrained_ms": 1e3 * tpot_u,
            "tpot_ratio": tpot_c / tpot_u if tpot_u else None,
            "tpot_ms_each_pass": {kind: [1e3 * t for t in values] for kind, values in tpots.items()},
            "throughput_constrained_tok_s": max(rates["constrained"]),
            "throughput_unconstrained_tok_s": max(rates["unconstrained"]),
            "num_answers": len(requests) * repeats, "num_valid": len(requests) * repeats - len(invalid),
            "invalid": invalid}


def _check(requests: list[Request], outcomes: list[Outcome]) -> dict[str, str]:
    """What is wrong with each invalid answer, by schema name and seed."""
    invalid = {}
    for request, outcome in zip(requests, outcomes, strict=True):
        assert request.schema is not None
        text = "".join(outcome.text)
        problem = (check_answer(text, request.schema) if outcome.finish_reason == "stop"
                   else f"finished by {outcome.finish_reason!r} after {len(outcome.token_ids)} tokens")
        if problem:
            invalid[f"{request.schema.name} (seed {request.params.seed})"] = f"{problem} ({text[:100]!r})"
    return invalid


def warm_up(engine: LLMEngine, requests: list[Request]) -> None:
    """Compile every grammar once (the engine's cache keeps them) and run a short constrained and a short
    unconstrained batch, so neither measured run pays a first call."""
    for request in requests:
        assert request.params.grammar is not None
        GrammarState.start(request.params.grammar, engine.tokenizer)
    short = [Request(r.prompt_token_ids, SamplingParams(max_tokens=4, temperature=1.0, seed=1,
                                                        grammar=r.params.grammar)) for r in requests[:4]]
    run_streams(engine, short, 4)
    run_streams(engine, [Request(r.prompt_token_ids, SamplingParams(max_tokens=4, ignore_eos=True))
                         for r in short], 4)


def select(corpus: Corpus, quick: bool) -> tuple[list[CorpusSchema], list[CorpusSchema]]:
    """(the c=16 schemas, the c=1 schemas)."""
    by_name = {schema.name: schema for schema in corpus.schemas}
    narrow = [by_name[name] for name in C1_SCHEMAS]
    if quick:
        return corpus.schemas[::4], narrow[:NUM_C1_QUICK]
    return corpus.schemas, narrow


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    start_s = time.perf_counter()
    corpus = load_corpus()
    wide, narrow = select(corpus, args.quick)
    engine = LLMEngine(Settings(dtype=args.dtype, num_threads=args.threads, seed=args.seed))
    log(f"{'quick' if args.quick else 'full'} run, {args.repeats} passes: {engine.model_id}, {engine.dtype}, "
        f"{torch.get_num_threads()} threads; c=16 over {len(wide)} schemas, c=1 over {len(narrow)}")
    requests = {16: constrained_requests(engine, wide, args.seed), 1: constrained_requests(engine, narrow, args.seed)}
    warm_up(engine, requests[16] + requests[1])
    timings = engine.runner.grammar_masks.timings
    timings.per_token_s.clear()
    results = {}
    for concurrency in (1, 16):
        log(f"c={concurrency}: {len(requests[concurrency])} constrained requests, then the same lengths free ...")
        results[concurrency] = run = measure(engine, requests[concurrency], concurrency, args.repeats)
        log(f"c={concurrency}: TPOT {run['tpot_constrained_ms']:.1f} ms constrained, "
            f"{run['tpot_unconstrained_ms']:.1f} ms free (x{run['tpot_ratio']:.3f}); "
            f"{run['num_valid']}/{run['num_answers']} valid")
        for name, problem in run["invalid"].items():
            log(f"  invalid: {name}: {problem}")
    num_answers = sum(r["num_answers"] for r in results.values())
    num_valid = sum(r["num_valid"] for r in results.values())
    mask_p50, mask_p99 = timings.percentile_s(50), timings.percentile_s(99)
    result = {
        "benchmark": "structured", "quick": args.quick, "seed": args.seed, "commit": git_commit(),
        "machine": machine_info(), "model": default_model_path().name, "dtype": str(engine.dtype),
        "tpot_ratio_c1": results[1]["tpot_ratio"], "tpot_ratio_c16": results[16]["tpot_ratio"],
        "throughput_ratio_c1": results[1]["throughput_constrained_tok_s"] / results[1]["throughput_unconstrained_tok_s"],
        "throughput_ratio_c16": (results[16]["throughput_constrained_tok_s"]
                                 / results[16]["throughput_unconstrained_tok_s"]),
        "validity": num_valid / num_answers, "num_answers": num_answers,
        "num_schemas": len({s.name for s in wide + narrow}),
        "mask_p50_us": None if mask_p50 is None else 1e6 * mask_p50,
        "mask_p99_us": None if mask_p99 is None else 1e6 * mask_p99,
        "c1": results[1], "c16": results[16],
        "corpus": {"num_schemas": len(corpus.schemas), "num_skipped": len(corpus.skipped)},
        "wall_s": time.perf_counter() - start_s,
    }
    write_result("structured", result, args.output)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.structured", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a quarter of the corpus at c=16, 3 schemas at c=1")
    parser.add_argument("--repeats", type=int, default=None,
                        help="passes of each (constrained, unconstrained) pair; the best TPOT of each counts "
                             "(default 3, --quick 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seeds start here (default 0)")
    parser.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="the engine's dtype (default auto: what a server runs)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--output", type=Path, default=None, help="result file (default benchmarks/results/)")
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


if __name__ == "__main__":
    main()
