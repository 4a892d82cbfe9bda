"""Conditional disaggregation: where a request's prompt is prefilled, as a pure decision.

A disaggregated gateway sends a prompt to a prefill worker, and its KV on to a decode worker, only when that
pays: a prompt with few uncached tokens (by the prefill router's view of the prefill workers' caches) costs
less to prefill on its decode worker than to prefill elsewhere and move; and while the prefill workers are
backed up, waiting for them costs more than prefilling on the decode worker (which then stalls its decodes
for one prefill step instead of leaving the prompt waiting behind others). Each outcome is a path name the
gateway counts (`dynserve_disagg_requests_total{path}`).
"""

from __future__ import annotations

from typing import Literal

__all__ = ["PrefillPath", "prefill_path"]

PrefillPath = Literal["remote", "short_prompt", "prefill_queue", "no_prefill_worker"]


def prefill_path(*, num_uncached_tokens: int, num_prefill_queued: int, num_prefill_workers: int,
                 local_prefill_tokens: int, max_prefill_queue: int) -> PrefillPath:
    """`remote` (prefill on a prefill worker) or why the decode worker prefills this prompt itself.

    `num_prefill_queued`: requests queued or running on the prefill workers, all together; the queue is
    over its limit when a new one would make them more than `max_prefill_queue` per worker."""
    if num_prefill_workers <= 0:
        return "no_prefill_worker"
    if num_uncached_tokens < local_prefill_tokens:
        return "short_prompt"
    if num_prefill_queued >= max_prefill_queue * num_prefill_workers:
        return "prefill_queue"
    return "remote"
