"""Schema validity over a corpus of real-world schemas: every answer parses and validates, sampled at
temperature 1.

The corpus (`benchmarks/_schema_corpus.py`, shared with `benchmarks.structured`): the SchemaStore schemas
vendored in `check-jsonschema` that the server accepts under `strict` (whole files and some of their
definitions) and our own (`tests/fixtures/schemas/`), each sent bounded so that every string, array and object
has a finite size, and checked against the schema as published and as sent.

Most answers come from a mocker worker through the gateway, asked with the official `openai` client: the
mocker draws uniformly among the tokens the grammar allows, so these answers wander into every corner the
grammar leaves open (what the grammar, the matcher, the worker's mask and the gateway's detokenization must
get right; a model's preferences would hide most of it). A few come from the real model at temperature 1.
An answer cut by `max_tokens` counts as a failure."""

from __future__ import annotations

import concurrent.futures
import json
from typing import Any

import openai
import pytest

from benchmarks._schema_corpus import Corpus, CorpusSchema, bounded, check_answer, load_corpus
from dynserve.config import Settings
from dynserve.protocol import Grammar, SamplingParams

MODEL = "SmolLM2-135M-Instruct"
ANSWERS_PER_SCHEMA = 5
MAX_TOKENS = 400  # the longest mocker answer over the corpus is under 200 tokens
MODEL_SCHEMAS = ("own:enums", "own:tool_call", "own:sentiment", "own:person")  # the real model's: short answers


@pytest.fixture(scope="module")
def corpus() -> Corpus:
    return load_corpus()


def _ask(client: openai.OpenAI, schema: CorpusSchema, seed: int) -> list[tuple[str, str | None]]:
    completion = client.chat.completions.create(
        model=MODEL, max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, n=ANSWERS_PER_SCHEMA,
        messages=[{"role": "user", "content": f"Write a JSON document for the schema {schema.name}."}],
        response_format={"type": "json_schema",  # type: ignore[arg-type]
                         "json_schema": {"name": "answer", "schema": schema.sent, "strict": True}})
    return [(choice.message.content or "", choice.finish_reason) for choice in completion.choices]


def _verdict(text: str, finish_reason: str | None, schema: CorpusSchema) -> str | None:
    if finish_reason != "stop":
        return f"finished by {finish_reason!r}: {text[:80]!r}"
    return check_answer(text, schema)


def test_bounded_schemas_only_narrow_the_published_ones() -> None:
    schema = {"type": "object", "properties": {"tags": {"type": "array"}, "name": {"type": "string"},
                                               "id": {"type": "string", "format": "uuid"}, "any": {}},
              "patternProperties": {"^x-": {"type": "string"}},
              "not": {"type": "object", "properties": {"name": {"const": "x"}}}}
    sent = bounded(schema)
    assert sent["additionalProperties"] is False and "patternProperties" not in sent
    tags, name, any_value = sent["properties"]["tags"], sent["properties"]["name"], sent["properties"]["any"]
    assert tags["maxItems"] == 3 and tags["items"]["maxLength"] == 12 and name["maxLength"] == 12
    assert "maxLength" not in sent["properties"]["id"]  # a fixed-size format is already bounded
    assert any_value["type"] == ["null", "boolean", "number", "string"]
    assert sent["not"] == schema["not"]  # a bound under `not` would widen the whole
    assert schema["properties"]["tags"] == {"type": "array"}  # the published schema is untouched
    document = {"tags": ["red"], "name": "a" * 13}
    problem = check_answer(json.dumps(document), CorpusSchema("t", schema, sent))
    assert problem is not None and "sent schema" in problem and "maxLength" not in json.dumps(schema)


@pytest.fixture(scope="module")
def model_answers(corpus: Corpus, make_engine: Any, tokenizer: Any) -> tuple[Any, list[CorpusSchema], list[Any]]:
    """(the engine, the schemas, the answers) of the real model asked for `MODEL_SCHEMAS`, batched."""
    by_name = {schema.name: schema for schema in corpus.schemas}
    chosen = [by_name[name] for name in MODEL_SCHEMAS]
    prompt = tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": "Answer with one JSON document."}]))
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i,
                             grammar=Grammar(kind="json_schema", source=json.dumps(schema.sent)))
              for i, schema in enumerate(chosen)]
    engine = make_engine(kv_blocks=128)
    return engine, chosen, engine.generate([prompt] * len(chosen), params)


def test_every_answer_over_the_corpus_is_valid(corpus: Corpus, make_mocker: Any, make_gateway: Any,
                                                model_answers: Any) -> None:
    _handle, info = make_mocker("corpus-0", mocker_speedup=1000.0, kv_blocks=512, namespace="so-corpus")
    server = make_gateway(infos=[info], namespace="so-corpus")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    problems: list[str] = []
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answered = list(pool.map(lambda item: _ask(client, item[1], seed=item[0]), enumerate(corpus.schemas)))
    num_answers = 0
    for schema, answers in zip(corpus.schemas, answered, strict=True):
        for text, finish_reason in answers:
            num_answers += 1
            problem = _verdict(text, finish_reason, schema)
            if problem:
                problems.append(f"{schema.name}: {problem}")

    _engine, chosen, results = model_answers  # a few from the real model at temperature 1, on the engine itself
    for schema, result in zip(chosen, results, strict=True):
        num_answers += 1
        problem = _verdict(result.text, result.finish_reason, schema)
        if problem:
            problems.append(f"{schema.name} (model): {problem}")

    num_schemastore = corpus.count("schemastore:")
    num_definitions = sum("#" in schema.name for schema in corpus.schemas)
    files_skipped = {name: reason for name, reason in corpus.skipped.items() if "#" not in name}
    print(f"\nschema validity: {num_answers - len(problems)}/{num_answers} answers valid, from "
          f"{len(corpus.schemas)} schemas ({num_schemastore - num_definitions} whole SchemaStore files, "
          f"{num_definitions} definitions of SchemaStore files, {corpus.count('own:')} ours); skipped: "
          f"{len(corpus.skipped) - len(files_skipped)} definitions tried, and these whole files:")
    for name, reason in files_skipped.items():
        print(f"  {name}: {reason}")
    assert not problems, "\n".join(problems)
    assert num_answers >= 200 and len(corpus.schemas) >= 30
    assert num_schemastore >= 20 and corpus.count("own:") >= 10


def test_the_engines_mask_times_are_a_worker_metric(model_answers: Any) -> None:
    from dynserve.workers.metrics import WorkerMetrics
    from dynserve.workers.mocker import MockEngine

    engine, _chosen, results = model_answers
    timings = engine.mask_timings
    assert timings.num_masks >= sum(len(result.token_ids) for result in results)  # one per constrained token
    families = {family.name: family for family in WorkerMetrics("w", "both", engine).collect()}
    samples = families["dynserve_worker_grammar_mask_seconds"].samples
    by_name = {sample.name: sample.value for sample in samples if sample.labels.get("le") in (None, "+Inf")}
    assert by_name["dynserve_worker_grammar_mask_seconds_count"] == timings.num_masks
    assert by_name["dynserve_worker_grammar_mask_seconds_sum"] == pytest.approx(timings.total_s)
    cumulative = [s.value for s in samples if s.name.endswith("_bucket")]
    assert cumulative == sorted(cumulative) and cumulative[-1] == timings.num_masks and cumulative[-2] > 0
    # a mocker times no masks: its series is there, at zero, so a dashboard's panel has one on every fleet
    mocker = {f.name: f for f in WorkerMetrics("m", "both", MockEngine(Settings(mocker="cpu"))).collect()}
    assert {s.value for s in mocker["dynserve_worker_grammar_mask_seconds"].samples} == {0.0}
