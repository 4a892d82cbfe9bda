"""Token selection from logits: penalties, greedy, temperature, top-k, top-p, seeds, logprobs.

Pure function of (logits, the sequences' parameters and outputs). Rows with a `seed` draw from their own
generator, so a seeded request gives the same tokens whatever else shares its batch. Logprobs are
log-softmax of the logits after penalties and before temperature.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dynserve.engine.sequence import Sequence
from dynserve.protocol import TokenLogprob

__all__ = ["SampleResult", "sample"]


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    for row, seq in enumerate(seqs):
        if not seq.output_counts:
            continue
        ids = torch.tensor(list(seq.output_counts), dtype=torch.long)
        counts = torch.tensor(list(seq.output_counts.values()), dtype=logits.dtype)
        penalty = seq.params.frequency_penalty * counts + seq.params.presence_penalty
        logits[row, ids] -= penalty


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int | None, top_p: float) -> torch.Tensor:
    """Mask (to -inf) tokens outside the top k and outside the smallest set holding top_p of the mass."""
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> SampleResult:
    """One token per row of `logits` ([num_seqs, vocab], fp32) for the matching sequence."""
    _apply_penalties(logits, seqs)
    greedy_ids = logits.argmax(dim=-1).tolist()
    token_ids: list[int] = []
    for row, seq in enumerate(seqs):
        params = seq.params
        if params.greedy:
            token_ids.append(greedy_ids[row])
            continue
        scaled = _filter_top_k_top_p(logits[row] / params.temperature, params.top_k, params.top_p)
        probs = scaled.softmax(-1)
        token_ids.append(int(torch.multinomial(probs, 1, generator=seq.sampling_generator()).item()))
    return SampleResult(token_ids, _logprobs(logits, seqs, token_ids))


def _logprobs(logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int]) -> list[TokenLogprob | None]:
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    out: list[TokenLogprob | None] = [None] * len(seqs)
    if not rows:
        return out
    logprobs = torch.log_softmax(logits[rows], dim=-1)
    for j, row in enumerate(rows):
        k = seqs[row].params.logprobs or 0
        top: list[tuple[int, float]] = []
        if k:
            values, ids = torch.topk(logprobs[j], k)
            top = list(zip(ids.tolist(), values.tolist(), strict=True))
        chosen = token_ids[row]
        out[row] = TokenLogprob(chosen, float(logprobs[j, chosen]), top)
    return out
