"""`benchmarks.pulls`' pure parts: the script is a function of the plan and seed, and the headline's ratios
come from the fleets' figures (the fleets themselves run in the benchmark, not here)."""

from __future__ import annotations

from benchmarks.pulls import FULL, QUICK, Result, headline, make_documents, summarize


def test_the_script_depends_on_the_plan_and_seed_alone() -> None:
    assert make_documents(QUICK, 0) == make_documents(QUICK, 0) != make_documents(QUICK, 1)
    documents = make_documents(FULL, 0)
    assert len(documents) == FULL.num_documents
    for system, questions in documents:
        assert len(system.split()) > FULL.document_words and len(questions) == FULL.burst
        assert len(set(questions)) > 1  # a burst's requests differ after the shared document


def _results(ttfts_s: list[float], cached: int, answer: str = "a") -> list[Result]:
    return [Result(0, q, ttft_s, 100, cached, answer) for q, ttft_s in enumerate(ttfts_s)]


def test_the_headline_compares_the_fleets_figures() -> None:
    without = _results([1.0, 2.0, 3.0], cached=20)
    with_pulls = _results([0.5, 0.5, 0.5], cached=90)
    figures = {"no_pulls": {**summarize(without), "gateway_pulls": {}},
               "pulls": {**summarize(with_pulls), "gateway_pulls": {'dynserve_kv_pulls_total{outcome="pulled"}': 2.0}}}
    assert figures["no_pulls"]["prefill_tokens"] == 240 and figures["pulls"]["prefill_tokens"] == 30
    result = headline(figures, True, {"no_pulls": without, "pulls": with_pulls})
    assert result["ttft_mean_ratio_no_pulls_over_pulls"] == 4.0
    assert result["prefill_tokens_saved_ratio"] == 1 - 30 / 240
    assert result["pulled"] == 2.0 and result["outputs_identical"] is True
    assert headline(figures, False, {"no_pulls": without, "pulls": with_pulls})["outputs_identical"] is None
    differs = headline(figures, True, {"no_pulls": without, "pulls": _results([0.5] * 3, 90, answer="b")})
    assert differs["outputs_identical"] is False
