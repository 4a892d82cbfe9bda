"""The tiers benchmark's figures from what the client saw, as pure functions, and its picture.

A turn is *returning* when it is not its conversation's first: its history was computed before, and every
other conversation has taken a turn since (see `_tiers_workload`). The prefill a turn computed is its prompt
tokens less the cached ones the server reported (`usage.prompt_tokens_details.cached_tokens`, which counts
blocks found on the device and blocks onboarded from a lower tier alike).

Outputs are compared turn by turn against a baseline policy (`none`, or the `device` control): under greedy
decoding a tier must not change an answer, since a block brought back from a tier holds the very KV that was
computed. Reusing a prefix's KV at all (a device hit included) can: the KV of a prefix computed in one
prefill chunk is not bit-equal to the same prefix recomputed inside a longer chunk in bf16, and a near tie
between two tokens can flip; the `device` control, whose returning turns are all device hits, tells that
apart from a tier's fault. A conversation whose answer differs at some turn differs in every later prompt
too, so only each conversation's first differing turn is listed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._common import percentile

__all__ = ["TurnResult", "compare_outputs", "headline", "plot", "summarize_policy"]

BASELINE = "none"


@dataclass(frozen=True, slots=True)
class TurnResult:
    conversation: int
    turn: int
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int
    answer: str

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def summarize_policy(turns: Sequence[TurnResult]) -> dict[str, Any]:
    """TTFT of returning turns (p50, mean, p90) and of first turns (mean), in ms; prefill tokens computed,
    in all and on returning turns; and the share of returning turns' prompt tokens found cached."""
    returning = [t for t in turns if t.turn > 0]
    first = [t for t in turns if t.turn == 0]
    ttfts_ms = [1000 * t.ttft_s for t in returning]
    returning_prompt = sum(t.prompt_tokens for t in returning)
    return {
        "num_turns": len(turns),
        "num_returning_turns": len(returning),
        "ttft_returning_p50_ms": percentile(ttfts_ms, 50),
        "ttft_returning_mean_ms": _mean(ttfts_ms),
        "ttft_returning_p90_ms": percentile(ttfts_ms, 90),
        "ttft_first_mean_ms": _mean([1000 * t.ttft_s for t in first]),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "prefill_tokens": sum(t.prefill_tokens for t in turns),
        "prefill_tokens_returning": sum(t.prefill_tokens for t in returning),
        "cached_share_returning": (sum(t.cached_tokens for t in returning) / returning_prompt
                                   if returning_prompt else None),
    }


def compare_outputs(turns_by_policy: Mapping[str, Sequence[TurnResult]],
                    baseline_name: str = BASELINE) -> dict[str, Any]:
    """Whether every policy's answers equal the baseline's, turn by turn; where not, each conversation's
    first differing turn per policy (with both answers), and turns one policy has and the baseline lacks."""
    baseline = {(t.conversation, t.turn): t.answer for t in turns_by_policy.get(baseline_name, ())}
    differences: list[dict[str, Any]] = []
    for name, turns in turns_by_policy.items():
        if name == baseline_name:
            continue
        seen: set[int] = set()
        for t in sorted(turns, key=lambda t: (t.conversation, t.turn)):
            expected = baseline.get((t.conversation, t.turn))
            if t.conversation in seen or expected == t.answer:
                continue
            seen.add(t.conversation)
            differences.append({"policy": name, "conversation": t.conversation, "turn": t.turn,
                                "answer": t.answer, "baseline_answer": expected})
    compared = [name for name in turns_by_policy if name != baseline_name]
    return {"outputs_identical": bool(baseline) and bool(compared) and not differences,
            "baseline": baseline_name, "compared": compared, "differences": differences}


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def headline(summaries: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """The issue's figures: mean TTFT of returning turns without tiers over with the host tier and with
    everything (`all`), and the share of the baseline's prefill tokens `all` did not compute (None where a
    policy did not run)."""
    def get(policy: str, key: str) -> float | None:
        return summaries[policy][key] if policy in summaries else None

    saved = _ratio(get("all", "prefill_tokens"), get(BASELINE, "prefill_tokens"))
    saved_returning = _ratio(get("all", "prefill_tokens_returning"),
                             get(BASELINE, "prefill_tokens_returning"))
    return {
        "ttft_ratio_none_over_host": _ratio(get(BASELINE, "ttft_returning_mean_ms"),
                                            get("host", "ttft_returning_mean_ms")),
        "ttft_ratio_none_over_host_disk": _ratio(get(BASELINE, "ttft_returning_mean_ms"),
                                                 get("host_disk", "ttft_returning_mean_ms")),
        "ttft_ratio_none_over_all": _ratio(get(BASELINE, "ttft_returning_mean_ms"),
                                           get("all", "ttft_returning_mean_ms")),
        "ttft_ratio_none_over_device": _ratio(get(BASELINE, "ttft_returning_mean_ms"),
                                              get("device", "ttft_returning_mean_ms")),
        "prefill_tokens_saved_ratio": None if saved is None else 1 - saved,
        "prefill_tokens_saved_ratio_returning": None if saved_returning is None else 1 - saved_returning,
    }


def plot(path: Path, turns_by_policy: Mapping[str, Sequence[TurnResult]], title: str) -> None:
    """The CDF of returning turns' TTFT per policy (log scale), and their mean as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    figure, (cdf_ax, bar_ax) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    names = list(turns_by_policy)
    means = []
    for name in names:
        ttfts_ms = sorted(1000 * t.ttft_s for t in turns_by_policy[name] if t.turn > 0)
        means.append(_mean(ttfts_ms) or 0.0)
        if ttfts_ms:
            cdf_ax.step(ttfts_ms, [(i + 1) / len(ttfts_ms) for i in range(len(ttfts_ms))], where="post",
                        label=name)
    cdf_ax.set_xscale("log")
    cdf_ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))  # 100, 200, 500, 1000, ...
    cdf_ax.xaxis.set_major_formatter(ScalarFormatter())
    cdf_ax.xaxis.set_minor_formatter(NullFormatter())
    cdf_ax.set_xlabel("TTFT of returning turns (ms, log scale)")
    cdf_ax.set_ylabel("share of returning turns")
    cdf_ax.legend(fontsize="small")
    bar_ax.bar(names, means, color=[f"C{i}" for i in range(len(names))])
    bar_ax.set_ylabel("mean TTFT of returning turns (ms)")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
