"""Token selection from logits: penalties, grammar masks, greedy, temperature, top-k, top-p, seeds, logprobs.

Pure function of (logits, the sequences' parameters and outputs, the step's grammar masks). Rows with a
`seed` draw from their own generator, so a seeded request gives the same tokens whatever else shares its
batch. A row with a grammar mask (`structured.GrammarMasks`) keeps only the tokens its grammar allows (the
others' logits become -inf) before it is chosen, greedy or drawn. Logprobs are log-softmax of the logits
after penalties and before the grammar's mask and temperature (what the model thinks of the chosen token).

Two implementations of one contract:
- `sample`: row by row on CPU logits (the CPU engine's path).
- `sample_on_device`: batched on the logits' device (a GPU's), reading back only the chosen ids and the
  logprobs asked for, in one transfer. It draws by the exponential race (`argmax(p / E)`, E ~ Exp(1) per
  token: a draw from p), top-k by rank after sorting (ties at the k-th value are cut, where `sample` keeps
  them). Greedy rows, penalties and logprobs equal `sample`'s; sampled rows follow the same distribution
  from another random stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from dynserve.engine.sequence import Sequence
from dynserve.protocol import TokenLogprob

if TYPE_CHECKING:
    from dynserve.engine.structured import GrammarMasks

__all__ = ["SampleResult", "allowed_tokens", "sample", "sample_on_device"]

_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


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


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool [rows, vocab_size] of int32 bitmasks [rows, words] (bit `i % 32` of word `i // 32` allows token
    `i`); tokens past the bitmask's end (a model vocabulary padded beyond its tokenizer's) are not allowed."""
    shifts = _BIT_SHIFTS.to(bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1).bool()
    if bits.shape[1] >= vocab_size:
        return bits[:, :vocab_size]
    return torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]), value=False)


def _apply_masks(logits: torch.Tensor, seqs: list[Sequence], masks: GrammarMasks | None) -> torch.Tensor:
    """Mask `logits` in place with the grammars' masks; returns the logits logprobs are taken from (a copy
    from before the masks when a masked row asks for logprobs, else `logits` itself)."""
    if masks is None:
        return logits
    before = logits
    if any(seqs[row].params.logprobs is not None for row in masks.rows):
        before = logits.clone()
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        _apply_masks_numpy(logits.numpy(), masks)
        return before
    rows = torch.tensor(masks.rows, device=logits.device)
    bitmask = torch.from_numpy(masks.bitmask).to(logits.device, non_blocking=True)
    allowed = allowed_tokens(bitmask, logits.shape[1])
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return before


_ADD_IF_ALLOWED = np.array([float("-inf"), 0.0], dtype=np.float32)  # added to a logit, by its allowed bit
_BIT_INDEX = np.arange(32)


def _apply_masks_numpy(values: np.ndarray, masks: GrammarMasks) -> None:
    """The masks on CPU logits, row by row in numpy on the step's own thread (torch's masked_fill on two
    threads took 1.5-8 ms for 16 rows of a 49k vocabulary here, waking its second thread). A row that allows
    a few tokens (a key, a bracket, a digit: most of a JSON document) keeps those, found from its non-zero
    words, and is filled with -inf around them (10 us); one that allows many (inside a string) gets -inf
    added where its bit is 0 (0.1 ms)."""
    vocab_size = values.shape[1]
    count = min(vocab_size, masks.bitmask.shape[1] * 32)  # tokens past the bitmask's end are never allowed
    for j, row in enumerate(masks.rows):
        logits, words = values[row], masks.bitmask[j]
        if int(np.bitwise_count(words).sum()) * 8 < vocab_size:
            nonzero = np.flatnonzero(words)
            bits = np.unpackbits(words[nonzero].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
            ids = (nonzero[:, None] * 32 + _BIT_INDEX)[bits.astype(bool)]
            ids = ids[ids < vocab_size]
            kept = logits[ids]
            logits.fill(float("-inf"))
            logits[ids] = kept
        else:
            allowed = np.unpackbits(words.view(np.uint8), count=count, bitorder="little")
            np.add(logits[:count], np.take(_ADD_IF_ALLOWED, allowed), out=logits[:count])
            logits[count:] = float("-inf")


def sample(logits: torch.Tensor, seqs: list[Sequence], masks: GrammarMasks | None = None) -> SampleResult:
    """One token per row of `logits` ([num_seqs, vocab], fp32) for the matching sequence; `masks` constrain
    the rows of sequences with a grammar."""
    _apply_penalties(logits, seqs)
    unmasked = _apply_masks(logits, seqs, masks)
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
    return SampleResult(token_ids, _logprobs(unmasked, seqs, token_ids))


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


def sample_on_device(logits: torch.Tensor, seqs: list[Sequence], masks: GrammarMasks | None = None) -> SampleResult:
    """`sample`'s contract for logits on any device, batched; one synchronizing read of the results."""
    num_rows, vocab = logits.shape
    device = logits.device
    _apply_penalties_batched(logits, seqs)
    unmasked = _apply_masks(logits, seqs, masks)
    token_ids = logits.argmax(dim=-1)
    drawn = [i for i, seq in enumerate(seqs) if not seq.params.greedy]
    if drawn:
        rows = torch.tensor(drawn, device=device)
        params = [seqs[i].params for i in drawn]
        temperature = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
        scaled = logits[rows] / temperature[:, None]
        if any(p.top_k is not None and p.top_k < vocab for p in params) or any(p.top_p < 1.0 for p in params):
            ordered, order = scaled.sort(dim=-1, descending=True)
            top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)
            top_p = torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=device)
            ranks = torch.arange(vocab, device=device)
            ordered = ordered.masked_fill(ranks[None, :] >= top_k[:, None], float("-inf"))
            probs = ordered.softmax(dim=-1)
            # rows without top-p keep everything (an fp32 cumsum can reach 1.0 before the tail)
            beyond = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1.0)
            ordered = ordered.masked_fill(beyond, float("-inf"))
            scaled = torch.empty_like(scaled).scatter_(1, order, ordered)  # back in vocabulary order
        probs = scaled.softmax(dim=-1)
        # drawn in vocabulary order, so a seeded row's draw does not depend on what shares its batch
        noise = torch.empty_like(probs).exponential_()
        for j, i in enumerate(drawn):
            generator = seqs[i].sampling_generator(device)
            if generator is not None:
                noise[j].exponential_(generator=generator)
        # a zero draw would make 0/0 = NaN, which argmax takes for the largest
        token_ids[rows] = (probs / noise.clamp_(min=torch.finfo(noise.dtype).tiny)).argmax(dim=-1)
    parts = [token_ids.double()]
    wanted = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    top_k_max = max((seqs[i].params.logprobs or 0 for i in wanted), default=0)
    if wanted:
        rows = torch.tensor(wanted, device=device)
        logprobs = torch.log_softmax(unmasked[rows], dim=-1)
        parts.append(logprobs.gather(1, token_ids[rows][:, None]).squeeze(1).double())
        if top_k_max:
            values, ids = torch.topk(logprobs, top_k_max, dim=-1)
            parts += [values.double().flatten(), ids.double().flatten()]
    flat = torch.cat(parts).tolist()  # the step's one read back (token ids are exact in float64)
    chosen = [int(t) for t in flat[:num_rows]]
    out: list[TokenLogprob | None] = [None] * num_rows
    if wanted:
        chosen_lp = flat[num_rows : num_rows + len(wanted)]
        top_values = flat[num_rows + len(wanted) : num_rows + len(wanted) * (1 + top_k_max)]
        top_ids = flat[num_rows + len(wanted) * (1 + top_k_max) :]
        for j, row in enumerate(wanted):
            k = seqs[row].params.logprobs or 0
            base = j * top_k_max
            top = [(int(top_ids[base + m]), top_values[base + m]) for m in range(k)]
            out[row] = TokenLogprob(chosen[row], chosen_lp[j], top)
    return SampleResult(chosen, out)


def _apply_penalties_batched(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """`_apply_penalties` in one indexed update (the same fp32 arithmetic: frequency x count + presence)."""
    rows: list[int] = []
    ids: list[int] = []
    terms: list[float] = []  # count, frequency penalty, presence penalty of each (row, token)
    for row, seq in enumerate(seqs):
        if not seq.output_counts:
            continue
        params = seq.params
        for token_id, count in seq.output_counts.items():
            rows.append(row)
            ids.append(token_id)
            terms += (count, params.frequency_penalty, params.presence_penalty)
    if rows:
        index = torch.tensor([rows, ids], device=logits.device)
        count, frequency, presence = torch.tensor(terms, dtype=logits.dtype, device=logits.device).view(-1, 3).unbind(1)
        logits.index_put_((index[0], index[1]), -(frequency * count + presence), accumulate=True)
