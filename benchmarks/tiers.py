"""KV tiers on long multi-turn chats: TTFT of returning turns and prefill computed, with and without the
host and disk tiers, on the real model (SmolLM2-135M, two aggregated workers, kv router), then on mocker
workers at a GPU profile.

    PYTHONPATH=$PWD .venv/bin/python -m benchmarks.tiers [--quick] [--policies none host host_disk all device]
        [--part both|real|mocker] [--mocker-profile NAME] [--mocker-speedup S] [--no-peer-pulls]

The workload (`_tiers_workload.py`, fixed seed): conversations that each open with a long context of their
own and append the previous answer and a new question every turn, played one turn at a time, round robin
over the conversations, greedy with short answers, so TTFT is the prefill (or the onboarding) of the
history. Each worker's device pool (`--kv-blocks`) holds about one conversation's largest request, and the
conversations' contexts add up to several times both pools together: when a conversation comes back, the
others have evicted it from the device. The same script is played against a fresh `dynctl serve` per policy:

- `none`: no tiers; a returning turn prefills its history again;
- `host`: a host tier that holds the whole workload (`--kv-host-bytes`); the router blind to the tiers
  (host and disk hit weights 0);
- `host_disk`: a host tier of half a device pool and a disk tier under a temporary directory
  (`--kv-disk-bytes`, `--kv-disk-dir`) that holds the rest; the router blind to the tiers;
- `all`: the tiers of `host_disk`, a router that credits host and disk hits (dynserve's default
  `--router-host-hit-weight` and `--router-disk-hit-weight`) and, the issue's fourth policy, workers that
  pull a prefix their peer holds (`--kv-peer-pulls`; `--no-peer-pulls` leaves them out); the result's
  `peer_pulls` says whether they ran;
- `device` (a control): no tiers, a device pool that holds the whole workload, so every returning turn is a
  device prefix hit: the best a tier can approach, and what prefix reuse alone does to greedy answers.

Reported per policy: TTFT of returning turns (every turn but a conversation's first: p50, mean, p90) and of
first turns; prefill tokens computed (prompt less cached, from each response's usage); the workers' tier
counters from their `/metrics` (blocks offloaded, onboarded and dropped per medium, onboard time, disk bytes,
pull bytes and time), the router's prompt blocks hit per medium and the gateway's peer pulls by outcome;
every answer; wall time and load average. Then
`ttft_ratio_none_over_host`, `ttft_ratio_none_over_all` (means of returning turns),
`prefill_tokens_saved_ratio` (1 - prefill tokens with `all` / without tiers) and `outputs_identical` (every
answer equal to `none`'s under greedy decoding; where not, each conversation's first differing turn) and
`outputs_identical_to_device` (the tiered policies' answers against the control's: reusing a prefix's KV,
on the device too, may flip a near tie in bf16, which no tier causes; `--dtype` runs the workers in
another dtype). A router blind to the tiers places a returning turn by the device blocks alone, so at a
conversation's first return it may choose the worker without its blocks, which then prefills them: `host`
and `host_disk` vary from run to run by that first return. The issue's targets, on the median of 3 full
runs: none/host >= 3, none/all >= 4.

The mocker part (`mocker` in the result; `--part mocker` runs it alone) plays the same script and policies
against `dynctl serve --mocker PROFILE` (default `llama-3.1-70b-h100-tp4`, speedup 1: real time): the same
device pools in blocks, the tiers in the same blocks of the profile's KV bytes. Its steps take the profile's
time, and a step that onboards blocks takes their bytes over the profile's host link or disk read bandwidth
more (`mocker_profiles`: estimates from datasheets), so its ratios are the policies' effect at GPU speeds as
the profile models them, plus this machine's gateway and router overhead in every TTFT. Its answers are
pseudo-random (a function of the prompt): no output comparison.

The last stdout line is the JSON result; a copy goes to `benchmarks/results/tiers-<timestamp>.json` and the
CDF of returning turns' TTFT per policy next to it (`.png`). `--quick`: 6 conversations of 3 turns on
400-word contexts; the full run: 8 conversations of 5 turns on 1,000-word contexts.
Measurements and their history: `docs/benchmarks.md` (tiers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks._common import RESULTS_DIR, git_commit, log, machine_info, write_result
from benchmarks._dynctl import DynctlServer, dynctl_serve, scrape_counters, scrape_worker_samples
from benchmarks._http import http_get, stream_chat
from benchmarks._tiers_report import TurnResult, compare_outputs, headline, plot, summarize_policy
from benchmarks._tiers_workload import (
    CONTROLS,
    FULL_PLAN,
    POLICIES,
    QUICK_PLAN,
    Conversation,
    Plan,
    Policy,
    Sizes,
    make_conversations,
    mocker_block_bytes,
    mocker_flags,
    policies,
    policy_flags,
    size_fleet,
    turn_order,
)
from dynserve.config import Settings
from dynserve.workers.mocker_profiles import PROFILES, get_profile

TARGETS = {"ttft_ratio_none_over_host": 3.0, "ttft_ratio_none_over_all": 4.0}
MOCKER_PROFILE = "llama-3.1-70b-h100-tp4"
PARTS = ("both", "real", "mocker")
NUM_WARM_UP = 4  # short chats before the timing, two per worker
_TIER_PREFIXES = ("dynserve_worker_kv_tier_", "dynserve_worker_kv_onboard_", "dynserve_worker_kv_disk_",
                  "dynserve_worker_kv_pull_")


async def _warm_up(port: int, model: str) -> None:
    """Short chats whose prompts the workload never uses (the router spreads them over both workers)."""
    for i in range(NUM_WARM_UP):
        words = " ".join(["warm"] * 200)
        await stream_chat(port, model, [{"role": "user", "content": f"Warm-up {i}: {words}"}], 4)


async def _play(port: int, model: str, plan: Plan, conversations: tuple[Conversation, ...],
                name: str) -> list[TurnResult]:
    """Every turn of the script in `turn_order`, one at a time, each conversation's answers fed back."""
    histories = [[{"role": "system", "content": c.system}] for c in conversations]
    results: list[TurnResult] = []
    for conversation, turn in turn_order(plan.num_conversations, plan.num_turns):
        messages = histories[conversation]
        messages.append({"role": "user", "content": conversations[conversation].questions[turn]})
        answer, ttft_s, usage = await stream_chat(port, model, messages, plan.max_tokens)
        messages.append({"role": "assistant", "content": answer})
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        results.append(TurnResult(conversation, turn, ttft_s, usage["prompt_tokens"], cached, answer))
        if conversation == plan.num_conversations - 1:
            done = [r for r in results if r.turn == turn]
            log(f"{name}: turn {turn}: mean TTFT {1000 * sum(r.ttft_s for r in done) / len(done):.0f} ms, "
                f"prompt {sum(r.prompt_tokens for r in done)} tokens, "
                f"cached {sum(r.cached_tokens for r in done)}")
    return results


# ---- metrics ----------------------------------------------------------------------------------------------


def _worker_tier_counters(gateway_port: int) -> dict[str, float]:
    """The workers' tier series summed over the workers, keyed `name` or `name{medium}`."""
    totals: dict[str, float] = {}
    for name, labels, value in scrape_worker_samples(gateway_port, _TIER_PREFIXES):
        key = name + (f"{{{labels['medium']}}}" if "medium" in labels else "")
        totals[key] = totals.get(key, 0.0) + value
    return totals


def _onboard_ms_per_block(counters: dict[str, float]) -> float | None:
    onboarded = sum(v for k, v in counters.items()
                    if k.startswith("dynserve_worker_kv_tier_onboarded_blocks"))
    seconds = sum(v for k, v in counters.items() if k.startswith("dynserve_worker_kv_onboard_seconds"))
    return 1000 * seconds / onboarded if onboarded else None


# ---- one policy -------------------------------------------------------------------------------------------


def _served_model(port: int) -> str:
    return json.loads(http_get(f"127.0.0.1:{port}", "/v1/models"))["data"][0]["id"]


def run_policy(policy: Policy, flags: list[str], plan: Plan, conversations: tuple[Conversation, ...],
               log_dir: Path, label: str | None = None) -> tuple[dict[str, Any], list[TurnResult]]:
    """A fresh fleet with `flags`, a warm-up, the whole script; the policy's figures and its turns. `label`
    names the fleet in the logs (default: the policy's name)."""
    label = label or policy.name
    log(f"{label}: starting dynctl serve {' '.join(flags)}")
    started_s = time.monotonic()
    load_start = os.getloadavg()[0]
    server: DynctlServer
    with dynctl_serve(f"tiers-{label}", flags, log_dir=log_dir) as server:
        ready_s = time.monotonic() - started_s
        model = _served_model(server.port)
        asyncio.run(_warm_up(server.port, model))
        play_start_s = time.monotonic()
        turns = asyncio.run(_play(server.port, model, plan, conversations, label))
        play_s = time.monotonic() - play_start_s
        tiers = _worker_tier_counters(server.port)
        router = scrape_counters(server.port, "dynserve_router_prompt")
        pulls = scrape_counters(server.port, "dynserve_kv_pulls")
    summary = summarize_policy(turns)
    figures = {"policy": asdict(policy), "flags": flags, "ready_s": ready_s, "play_s": play_s,
               "wall_s": time.monotonic() - started_s, "load_avg_1m_start": load_start,
               "load_avg_1m_end": os.getloadavg()[0], **summary,
               "onboard_ms_per_block": _onboard_ms_per_block(tiers), "worker_tiers": tiers, "router": router,
               "peer_pulls": pulls,
               "turns": [asdict(t) for t in turns]}
    log(f"{label}: returning turns' TTFT mean {summary['ttft_returning_mean_ms']:.0f} ms, "
        f"p50 {summary['ttft_returning_p50_ms']:.0f} ms; prefill {summary['prefill_tokens']} of "
        f"{summary['prompt_tokens']} prompt tokens; played in {play_s:.0f} s, "
        f"load {figures['load_avg_1m_end']:.1f}")
    return figures, turns


def _page_sizes(block_size: int, dtype_name: str | None) -> tuple[int, int, str]:
    """(a block's KV bytes in memory, its disk file's bytes, the KV dtype) for the default model as the
    workers will run it (`dtype_name`, else the default resolved on this machine, as theirs is)."""
    import torch

    from dynserve.engine.kv_disk import PageLayout
    from dynserve.engine.llm_engine import resolve_dtype
    from dynserve.model.gguf_metadata import read_gguf_metadata
    from dynserve.model.resolve import resolve_model_path

    meta = read_gguf_metadata(resolve_model_path(None))
    arch = meta["general.architecture"]
    num_heads = meta[f"{arch}.attention.head_count"]
    head_dim = meta.get(f"{arch}.attention.key_length") or meta[f"{arch}.embedding_length"] // num_heads
    dtype = resolve_dtype(dtype_name or Settings.model_fields["dtype"].default, torch.device("cpu"))
    shape = (meta[f"{arch}.block_count"], 2, block_size, meta[f"{arch}.attention.head_count_kv"], head_dim)
    layout = PageLayout(dtype, shape, block_size, 0)
    return layout.page_bytes, layout.file_bytes(), str(dtype).removeprefix("torch.")


# ---- main -------------------------------------------------------------------------------------------------


def peer_pulls_available() -> bool:
    """Whether this checkout's workers can pull a prefix from a peer (`Settings.kv_peer_pulls`)."""
    return "kv_peer_pulls" in Settings.model_fields


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.tiers", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="6 conversations of 3 turns on shorter contexts")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", nargs="+", choices=POLICIES + CONTROLS, default=[*POLICIES, *CONTROLS],
                        help="policies in order; `device` (no tiers, a device pool holding the whole "
                             "workload) is a control [default: none host host_disk all device]")
    parser.add_argument("--dtype", default=None,
                        help="the workers' --dtype, e.g. float32 to check outputs without bf16 rounding "
                             "[default: dynserve's]")
    parser.add_argument("--no-peer-pulls", action="store_true",
                        help="`all` without peer pulls even where the settings have them (the tiers and the "
                             "tier-aware router alone)")
    parser.add_argument("--part", choices=PARTS, default="both",
                        help="the real model's fleets, the mocker's, or both, real first [default: both]")
    parser.add_argument("--mocker-profile", choices=sorted(PROFILES), default=MOCKER_PROFILE,
                        help=f"the mocker part's profile [default: {MOCKER_PROFILE}]")
    parser.add_argument("--mocker-speedup", type=float, default=1.0,
                        help="the mocker part's --mocker-speedup [default: 1, real time]")
    parser.add_argument("--output", type=Path, default=None)
    return parser.parse_args(argv)


Played = tuple[dict[str, Any], dict[str, list[TurnResult]]]  # (a part's figures, each policy's turns)


def _play_policies(label: str, flags_of: Callable[[Policy, Path], list[str]],
                   all_policies: dict[str, Policy], names: list[str], plan: Plan,
                   conversations: tuple[Conversation, ...], tmp: Path) -> Played:
    """Each policy of `names` played on a fresh fleet (`flags_of(policy, its disk directory)`)."""
    figures: dict[str, Any] = {}
    turns_by_policy: dict[str, list[TurnResult]] = {}
    for name in names:
        policy = all_policies[name]
        disk_dir = tmp / f"disk-{label}-{name}"
        disk_dir.mkdir()
        figures[name], turns_by_policy[name] = run_policy(policy, flags_of(policy, disk_dir), plan,
                                                          conversations, tmp, label=f"{label}{name}")
    return figures, turns_by_policy


def _real_part(args: argparse.Namespace, plan: Plan, conversations: tuple[Conversation, ...], sizes: Sizes,
               all_policies: dict[str, Policy], tmp: Path) -> Played:
    """The real model's fleets: the figures of the result's top level, and each policy's turns."""
    page_bytes, file_bytes, dtype = _page_sizes(plan.block_size, args.dtype)
    log(f"real model: KV {dtype}, {page_bytes} bytes a block")

    def flags_of(policy: Policy, disk_dir: Path) -> list[str]:
        flags = policy_flags(policy, sizes, page_bytes=page_bytes, disk_file_bytes=file_bytes,
                             disk_dir=str(disk_dir))
        return flags + (["--dtype", args.dtype] if args.dtype else [])

    figures, turns_by_policy = _play_policies("", flags_of, all_policies, args.policies, plan, conversations,
                                              tmp)
    outputs = compare_outputs(turns_by_policy)
    if outputs["differences"]:
        log(f"answers differ from none's: {json.dumps(outputs['differences'])[:2000]}")
    tiered = {name: turns for name, turns in turns_by_policy.items() if name != "none"}
    to_device = compare_outputs(tiered, "device") if "device" in tiered else None
    if to_device is not None and to_device["differences"]:
        log(f"answers differ from the device control's: {json.dumps(to_device['differences'])[:2000]}")
    return {
        "kv_dtype": dtype, "kv_block_bytes": page_bytes, "kv_disk_file_bytes": file_bytes,
        **headline(figures),
        "outputs_identical": outputs["outputs_identical"], "output_differences": outputs["differences"],
        "outputs_identical_to_device": to_device["outputs_identical"] if to_device else None,
        "output_differences_to_device": to_device["differences"] if to_device else None,
        "policies": figures,
    }, turns_by_policy


def _mocker_part(args: argparse.Namespace, plan: Plan, conversations: tuple[Conversation, ...], sizes: Sizes,
                 all_policies: dict[str, Policy], tmp: Path) -> Played:
    """The mocker's fleets at `args.mocker_profile`: the result's `mocker` object, and each policy's turns."""
    profile = get_profile(args.mocker_profile)
    block_bytes = mocker_block_bytes(profile.kv_bytes_per_token, plan.block_size)
    onboard_ms = {"host": profile.onboard_time_ms(block_bytes, 0),
                  "disk": profile.onboard_time_ms(0, block_bytes)}
    log(f"mocker: {profile.name} at speedup {args.mocker_speedup:g}, {block_bytes} bytes a block, onboarding "
        f"{onboard_ms['host']:.3f} ms a block from host, {onboard_ms['disk']:.3f} ms from disk")

    def flags_of(policy: Policy, _disk_dir: Path) -> list[str]:  # the mocker's disk tier writes nothing
        flags = policy_flags(policy, sizes, page_bytes=block_bytes, disk_file_bytes=block_bytes,
                             disk_dir=None)
        return flags + mocker_flags(profile.name, args.mocker_speedup)

    figures, turns_by_policy = _play_policies("mocker-", flags_of, all_policies, args.policies, plan,
                                              conversations, tmp)
    return {
        "profile": profile.name, "speedup": args.mocker_speedup, "kv_block_bytes": block_bytes,
        "kv_host_link_gbps": profile.kv_host_link_gbps, "kv_disk_read_gbps": profile.kv_disk_read_gbps,
        "modelled_onboard_ms_per_block": onboard_ms,
        "modelled_prefill_ms_per_block": profile.prefill_ms_per_token * plan.block_size,
        **headline(figures), "policies": figures,
    }, turns_by_policy


def _plot(output: Path, suffix: str, turns_by_policy: dict[str, list[TurnResult]], what: str) -> str:
    png = output.with_name(output.stem + suffix + ".png")
    png.parent.mkdir(parents=True, exist_ok=True)
    plot(png, turns_by_policy, f"dynserve KV tiers: TTFT of returning chat turns ({what})")
    return str(png)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    conversations = make_conversations(plan, args.seed)
    sizes: Sizes = size_fleet(plan, conversations)
    peer_pulls = peer_pulls_available() and not args.no_peer_pulls
    all_policies = policies(sizes, peer_pulls=peer_pulls)
    log(f"{plan.num_conversations} conversations x {plan.num_turns} turns; device pool {sizes.device_blocks} "
        f"blocks a worker, the workload {sizes.workload_blocks} blocks; peer pulls in `all`: {peer_pulls}")
    output = args.output or RESULTS_DIR / f"tiers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    kind = "quick" if args.quick else "full"
    start_s = time.monotonic()
    real: dict[str, Any] = {**headline({}), "outputs_identical": None, "policies": {}}  # unless it runs
    mocker: dict[str, Any] | None = None
    pngs: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="tiers-bench-") as tmp:
        if args.part in ("both", "real"):
            real, turns = _real_part(args, plan, conversations, sizes, all_policies, Path(tmp))
            if turns:
                pngs["png"] = _plot(output, "", turns, f"{kind}, SmolLM2-135M, 2 workers, "
                                                       f"{sizes.device_blocks}-block device pools")
        if args.part in ("both", "mocker"):
            mocker, turns = _mocker_part(args, plan, conversations, sizes, all_policies, Path(tmp))
            if turns:
                mocker["png"] = _plot(output, "-mocker", turns, f"{kind}, mocker {args.mocker_profile}, "
                                      f"2 workers, {sizes.device_blocks}-block device pools")
    result: dict[str, Any] = {
        "benchmark": "tiers", "quick": args.quick, "seed": args.seed, "part": args.part,
        "commit": git_commit(),
        "machine": machine_info(), "plan": asdict(plan), "sizes": asdict(sizes),
        "router_tier_weights_all": {"host": Settings.model_fields["router_host_hit_weight"].default,
                                    "disk": Settings.model_fields["router_disk_hit_weight"].default},
        **real, "targets": TARGETS, "peer_pulls": peer_pulls, "mocker": mocker,
        "wall_s": time.monotonic() - start_s, **pngs,
    }
    write_result("tiers", result, output)
    return result


if __name__ == "__main__":
    main()
