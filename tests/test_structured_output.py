"""Structured output: answers that match their schema, regex or choice by construction.

The gateway's side (which fields ask for which grammar, and the 400s for bad ones) is checked on parsed
requests; the engine's on the real model (a grammar beside unconstrained neighbours through continuous
batching, chunked prefill and preemption; a prefill worker's first token continued by a decode worker; a
migrated request continued from the tokens already sent); the whole path with the official `openai` client
against the session's gateway over a real model worker; and a worker killed mid-answer under a strict schema
on a mocker fleet (mockers draw among the tokens the grammar allows)."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from dynserve.errors import InvalidRequestError
from dynserve.gateway.preprocess import prepare_chat
from dynserve.gateway.schemas import ChatCompletionRequest
from dynserve.gateway.structured import grammar_of
from dynserve.protocol import Grammar, RemotePrefill, SamplingParams

MODEL = "SmolLM2-135M-Instruct"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Rome"]},
                                         "year": {"type": "integer", "minimum": 1000, "maximum": 2100}},
        "required": ["city", "year"], "additionalProperties": False}
CITY_GRAMMAR = Grammar(kind="json_schema", source=json.dumps(CITY))
QUESTION = [{"role": "user", "content": "Which city is the capital of France, and when was it founded? JSON."}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": QUESTION, **fields})


def _json_schema(schema: Any, **extra: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, **extra}}


# ---- the gateway's reading of a request -------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "kind", "lenient"), [
    ({"response_format": {"type": "json_object"}}, "json_schema", False),
    ({"response_format": _json_schema(CITY, strict=True)}, "json_schema", False),
    ({"response_format": _json_schema({"type": "object", "not": {"type": "null"}})}, "json_schema", True),
    ({"structured_outputs": {"regex": r"\d{3}"}}, "regex", False),
    ({"structured_outputs": {"choice": ["yes", 'say "no"']}}, "lark", False),
    ({"structured_outputs": {"grammar": 'start: "a"+'}}, "lark", False),
    ({"structured_outputs": {"json": json.dumps(CITY)}}, "json_schema", False),
    ({"guided_choice": ["x"]}, "lark", False),
    ({"guided_json": CITY}, "json_schema", False),
])
def test_each_constraint_field_becomes_one_grammar(fields: dict[str, Any], kind: str, lenient: bool,
                                                   tokenizer: Any) -> None:
    grammar = prepare_chat(chat(**fields), tokenizer, 8192).params[0].grammar
    assert grammar is not None and (grammar.kind, grammar.lenient) == (kind, lenient)
    assert grammar_of(chat(response_format={"type": "text"})) is None


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"response_format": _json_schema({"type": "frobnicate"})}, "response_format.json_schema.schema",
     "not a valid JSON Schema"),
    ({"response_format": _json_schema({"properties": {"a": {"minimum": "x"}}})},
     "response_format.json_schema.schema", "$.properties.a.minimum"),
    ({"response_format": _json_schema({"not": {"type": "null"}}, strict=True)},
     "response_format.json_schema.schema", "Unimplemented keys"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": CITY}}},
     "response_format.json_schema.name", "name"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "not supported"),
    ({"response_format": "json"}, "response_format", "object"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "unclosed group"),
    ({"structured_outputs": {"grammar": "start: missing"}}, "structured_outputs.grammar", "missing"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", "not supported"),
    ({"guided_json": "{bad"}, "guided_json", "not valid JSON"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "only one"),
])
def test_bad_constraints_are_400s_naming_the_field(fields: dict[str, Any], param: str, words: str,
                                                    tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        prepare_chat(chat(**fields), tokenizer, 8192)
    assert info.value.param == param
    assert words in str(info.value)


# ---- the engine ---------------------------------------------------------------------------------------------

def _valid_city(text: str) -> dict[str, Any]:
    document = json.loads(text)
    jsonschema.validate(document, CITY)
    return document


@pytest.fixture(scope="module")
def prompt(tokenizer: Any) -> list[int]:
    return tokenizer.encode(tokenizer.apply_chat_template(QUESTION))


@pytest.fixture(scope="module")
def reference(make_engine: Any, prompt: list[int]) -> Any:
    """The greedy constrained answer, alone on a roomy engine."""
    result = make_engine(kv_blocks=64).generate([prompt], SamplingParams(max_tokens=24, temperature=0,
                                                                          grammar=CITY_GRAMMAR))[0]
    assert result.finish_reason == "stop"  # the grammar completed, before max_tokens
    _valid_city(result.text)
    return result


def test_both_samplers_keep_masked_rows_inside_their_masks() -> None:
    import numpy as np
    import torch

    from dynserve.engine.sampler import sample, sample_on_device
    from dynserve.engine.sequence import Sequence
    from dynserve.engine.structured import GrammarMasks

    vocab = 70  # past the bitmasks' 64 bits: tokens 64-69 are never allowed (a model vocabulary padded
    bitmask = np.zeros((2, 2), dtype=np.uint32)  # beyond its tokenizer's)
    bitmask[0, 0], bitmask[0, 1] = 1 << 3, 1 << (41 - 32)  # row 0: tokens 3 and 41
    bitmask[1, 1] = 1  # row 2: token 32 only
    masks = GrammarMasks([0, 2], bitmask.view(np.int32))
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, 69] = 50.0  # the model's favourite, outside every mask
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, logprobs=0)
        for sampler in (sample, sample_on_device):
            seqs = [Sequence(f"s{i}", [1], params) for i in range(3)]
            result = sampler(logits.clone(), seqs, masks)
            assert result.token_ids[0] in (3, 41) and result.token_ids[2] == 32
            assert result.token_ids[1] == 69 or temperature > 0  # the unmasked row is free
            chosen = result.logprobs[2]
            assert chosen is not None  # the model's own view of the forced token, not a certainty
            assert chosen.logprob == pytest.approx(float(torch.log_softmax(logits[2], -1)[32]), abs=1e-4)


def test_masks_are_the_same_computed_inline_or_beside_the_forward(tokenizer: Any) -> None:
    import types

    import torch

    from dynserve.engine.model_runner import masks_overlap_forward
    from dynserve.engine.structured import GrammarState, MaskFiller

    answer = tokenizer.encode('{"city": "Rome"')
    states = [GrammarState.start(CITY_GRAMMAR, tokenizer, answer[:n]) for n in (0, 3, 5)]
    # three constrained rows and a free one; the second constrained row is mid-prefill (it does not sample)
    seqs = [types.SimpleNamespace(token_ids=[1, 2], num_computed_tokens=1, grammar=states[0]),
            types.SimpleNamespace(token_ids=[1, 2], num_computed_tokens=1, grammar=None),
            types.SimpleNamespace(token_ids=[1, 2, 3], num_computed_tokens=0, grammar=states[1]),
            types.SimpleNamespace(token_ids=[1, 2], num_computed_tokens=1, grammar=states[2])]
    num_new = [1, 1, 2, 1]
    beside = MaskFiller(overlap=True)
    try:
        a = beside.start(seqs, num_new)
        assert a is not None and a.num_rows == 3
        first = a.result()  # (a matcher serves one caller at a time)
    finally:
        beside.close()
    assert first.rows == [0, 2] and first.bitmask.any(axis=1).all()
    inline = MaskFiller(overlap=False)
    b = inline.start(seqs, num_new)
    assert b is not None and b.num_rows == 3
    second = b.result()
    assert second.rows == first.rows and (second.bitmask == first.bitmask).all()
    assert inline.timings.num_masks == 2
    assert masks_overlap_forward(torch.device("cuda"))  # an accelerator: always beside the forward
    assert masks_overlap_forward(torch.device("cpu")) == (torch.get_num_threads() < len(os.sched_getaffinity(0)))


def test_a_grammar_survives_batching_chunked_prefill_and_preemption(make_engine: Any, prompt: list[int],
                                                                    reference: Any, tokenizer: Any) -> None:
    story = tokenizer.encode("Here is a long story about a dragon who learned to bake bread. " * 3)[:30]
    recipe = tokenizer.encode("A recipe for pancakes, written for a child who has never cooked. " * 3)[:30]
    terse = tokenizer.encode(tokenizer.apply_chat_template([{"role": "system", "content": "Be terse."}, *QUESTION]))
    free = SamplingParams(max_tokens=14, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=24, temperature=1.0, seed=7, grammar=CITY_GRAMMAR)
    greedy = SamplingParams(max_tokens=24, temperature=0, grammar=CITY_GRAMMAR)
    prompts = [story, prompt, recipe, terse]
    params = [free, greedy, free, sampled]
    roomy = make_engine(kv_blocks=64).generate(prompts, params)
    # prompts of 2-3 blocks (46 tokens: two chunks of at most 32), each growing by 1-2 blocks: three run at
    # once in 9 blocks, and preempt each other when they grow
    small = make_engine(kv_blocks=9, max_num_batched_tokens=32)
    tight = small.generate(prompts, params)
    assert small.stats.num_preemptions > 0
    assert [r.token_ids for r in tight] == [r.token_ids for r in roomy]  # neighbours untouched, grammar kept
    assert tight[1].token_ids == reference.token_ids
    for result in (tight[1], tight[3]):
        _valid_city(result.text)
        assert result.finish_reason == "stop"
    assert len(tight[0].token_ids) == 14  # the unconstrained neighbours ran free
    small.block_manager.check_integrity(small.scheduler.running)
    timings = small.runner.grammar_masks.timings
    assert timings.num_masks >= len(tight[1].token_ids) + len(tight[3].token_ids)


def test_a_decode_worker_continues_the_prefill_workers_grammar(make_engine: Any, prompt: list[int],
                                                               reference: Any) -> None:
    prefill, decode = make_engine(kv_blocks=32), make_engine(kv_blocks=32)
    params = SamplingParams(max_tokens=24, temperature=0, grammar=CITY_GRAMMAR)
    prefill.add_request(prompt, params, "r", prefill_only=True)
    while not (deltas := prefill.step()):
        pass
    [first] = deltas
    assert first.finish_reason == "prefilled" and first.token_ids == reference.token_ids[:1]
    remote = RemotePrefill(handle=first.kv_handle, first_token_id=first.token_ids[0])
    decode.add_request(prompt, params, "r", remote=remote)
    [plan] = decode.drain_receives()
    decode.complete_receive("r", "transfer_error")  # (prefilled again here: the pages are test_disagg's)
    tokens = list(first.token_ids)
    while decode.has_unfinished_requests():
        tokens += [t for d in decode.step() for t in d.token_ids]
    assert tokens == reference.token_ids
    assert prefill.release("r")
    # a first token the grammar forbids is refused, never continued
    bad = RemotePrefill(handle=first.kv_handle, first_token_id=prompt[-1])
    with pytest.raises(InvalidRequestError, match="does not match the grammar"):
        decode.add_request(prompt, params, "r2", remote=bad)


def test_a_migrated_request_continues_its_grammar(make_engine: Any, prompt: list[int], reference: Any) -> None:
    sent = reference.token_ids[:5]  # what the client had when the first worker died
    engine = make_engine(kv_blocks=32)
    grammar = Grammar(kind="json_schema", source=CITY_GRAMMAR.source, num_prior_tokens=len(sent))
    rest = engine.generate([prompt + sent], SamplingParams(max_tokens=24 - len(sent), temperature=0,
                                                            grammar=grammar))[0]
    assert sent + rest.token_ids == reference.token_ids
    # tokens that the grammar could not have produced are refused, not continued from
    broken = Grammar(kind="json_schema", source=CITY_GRAMMAR.source, num_prior_tokens=3)
    with pytest.raises(InvalidRequestError, match="do not match the grammar"):
        engine.add_request(prompt, SamplingParams(max_tokens=4, grammar=broken))


# ---- through the gateway, with the official client ----------------------------------------------------------

class Founding(pydantic.BaseModel):
    city: Literal["Paris", "London", "Rome"]
    year: int = pydantic.Field(ge=1000, le=2100)


def test_parse_with_a_pydantic_model(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(model=MODEL, messages=QUESTION, response_format=Founding,
                                               max_tokens=24, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Founding)


def test_json_schema_strict_and_not_sampled_at_temperature_1(client: openai.OpenAI) -> None:
    for strict in (True, False):
        completion = client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=24, temperature=1.0, seed=11, n=3,
            response_format=_json_schema(CITY, strict=strict))  # type: ignore[arg-type]
        for choice in completion.choices:
            assert choice.finish_reason == "stop"
            _valid_city(choice.message.content or "")


def test_json_object_regex_and_choice(client: openai.OpenAI) -> None:
    obj = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                         response_format={"type": "json_object"})
    if obj.choices[0].finish_reason == "stop":  # any object: the model may run on past 24 tokens
        assert isinstance(json.loads(obj.choices[0].message.content or ""), dict)
    else:
        assert (obj.choices[0].message.content or "").startswith("{")
    regex = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12, temperature=1.0,
                                           seed=3, extra_body={"structured_outputs": {"regex": r"[A-Z][a-z]{2,8} \d{4}"}})
    assert re.fullmatch(r"[A-Z][a-z]{2,8} \d{4}", regex.choices[0].message.content or "")
    assert regex.choices[0].finish_reason == "stop"
    choices = ["Paris", "London", 'the "Big" Apple']
    picked = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=1.0,
                                       n=2, seed=5, extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in picked.choices)


def test_a_bad_schema_is_a_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4,
                                       response_format=_json_schema({"type": "object", "required": "city"}))  # type: ignore[arg-type]
    assert info.value.status_code == 400
    assert info.value.body["param"] == "response_format.json_schema.schema"
    assert "not a valid JSON Schema" in info.value.message and "required" in info.value.message


# ---- a worker killed mid-answer (mockers: tokens drawn among those the grammar allows) ---------------------

COLOURS = {"type": "object", "properties": {"colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                        "minItems": 12, "maxItems": 12}},
           "required": ["colours"], "additionalProperties": False}


@pytest.fixture(scope="module")
def mocker_fleets(make_mocker: Any) -> dict[str, list[tuple[Any, Any]]]:
    """Two small mocker fleets in one namespace: `migration` (two workers) and `disagg` (a prefill and a
    decode worker); (handle, info) each."""
    fleet = {"mocker_speedup": 2.0, "kv_blocks": 64, "namespace": "so-fleet"}
    return {"migration": [make_mocker(f"so-{i}", **fleet) for i in range(2)],
            "disagg": [make_mocker(f"so-{role}", role, **{**fleet, "mocker_speedup": 50.0})
                       for role in ("prefill", "decode")]}


def test_a_worker_killed_mid_answer_still_gives_one_valid_document(mocker_fleets: Any, make_gateway: Any,
                                                                   ray_instance: Any) -> None:
    mocker_pair = mocker_fleets["migration"]
    server = make_gateway(infos=[info for _handle, info in mocker_pair], namespace="so-fleet")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=200, stream=True,
                                            response_format=_json_schema(COLOURS, strict=True))  # type: ignore[arg-type]
    pieces, reasons, killed = [], [], False
    for chunk in stream:
        pieces.append(chunk.choices[0].delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
        if len(pieces) == 6 and not killed:
            busy = [h for h, _info in mocker_pair if ray_instance.get(h.load.remote()).num_running]
            ray_instance.kill(busy[0])
            killed = True
    assert killed, "the answer ended before the kill"
    document = json.loads("".join(pieces))
    jsonschema.validate(document, COLOURS)
    assert reasons[-1] == "stop"
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(r'^dynserve_migrations_total\{reason="worker_failed"\} 1\.0$', metrics, re.MULTILINE)


def test_a_vllm_worker_gets_vllms_own_parameters_and_an_openai_server_refuses(tokenizer: Any) -> None:
    from dynserve.protocol import GenerateRequest, WorkerInfo
    from dynserve.workers.openai_channel import completion_body

    def body(engine: str, grammar: Grammar) -> dict[str, Any]:
        info = WorkerInfo(worker_id="v", role="both", host="h", port=1, model_id=MODEL, max_model_len=2048,
                          block_size=16, num_blocks=8, engine=engine)
        request = GenerateRequest(request_id="r", token_ids=[1, 2], params=SamplingParams(grammar=grammar))
        return completion_body(info, request, [1, 2])

    assert body("vllm", CITY_GRAMMAR)["structured_outputs"] == {"json": CITY}
    assert body("vllm", Grammar(kind="regex", source="a+"))["structured_outputs"] == {"regex": "a+"}
    with pytest.raises(InvalidRequestError, match="cannot continue a grammar"):  # a migration: never restarted
        body("vllm", Grammar(kind="regex", source="a+", num_prior_tokens=2))
    with pytest.raises(InvalidRequestError, match="cannot enforce"):
        body("openai", CITY_GRAMMAR)


def test_a_disaggregated_answer_keeps_its_grammar_from_the_prefill_workers_first_token(
        mocker_fleets: Any, make_gateway: Any) -> None:
    infos = [info for _handle, info in mocker_fleets["disagg"]]
    server = make_gateway(infos=infos, namespace="so-fleet", disagg_local_prefill_tokens=0)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    for stream in (False, True):
        answer = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=200, stream=stream,
                                                response_format=_json_schema(COLOURS, strict=True))  # type: ignore[arg-type]
        if stream:
            text = "".join(chunk.choices[0].delta.content or "" for chunk in answer)  # type: ignore[union-attr]
        else:
            text = answer.choices[0].message.content or ""  # type: ignore[union-attr]
        jsonschema.validate(json.loads(text), COLOURS)
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert re.search(r'^dynserve_disagg_requests_total\{path="remote"\} 2\.0$', metrics, re.MULTILINE)


# ---- tools ----------------------------------------------------------------------------------------------------

WEATHER_ARGS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER_ARGS, "strict": True}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a city now",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 16}},
                                               "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


def _valid_call(name: str, arguments: str) -> None:
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)
    jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frob"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tools_are_400s_naming_the_field(fields: dict[str, Any], param: str, tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError) as info:
        prepare_chat(chat(**fields), tokenizer, 8192)
    assert info.value.param == param


def test_tools_on_a_text_completion_are_refused(tokenizer: Any) -> None:
    from dynserve.gateway.preprocess import prepare_completion
    from dynserve.gateway.schemas import CompletionRequest

    request = CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", "tools": TOOLS})
    with pytest.raises(InvalidRequestError, match="chat/completions only"):
        prepare_completion(request, tokenizer, 8192)


def test_a_named_tool_is_called_with_arguments_that_match_its_schema(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, max_tokens=48, temperature=0,  # type: ignore[arg-type]
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False)
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    _valid_call(call.function.name, call.function.arguments)


def test_required_calls_stream_as_tool_call_deltas(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                                            max_tokens=80, temperature=1.0, seed=2, stream=True)
    calls: dict[int, dict[str, Any]] = {}
    reasons, num_argument_deltas = [], 0
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.content  # a required call leaves no room for text
        for call in delta.tool_calls or []:
            if call.id is not None:  # a call's first delta: its id and name
                assert call.index not in calls and call.function and call.function.name
                calls[call.index] = {"id": call.id, "name": call.function.name, "arguments": ""}
            elif call.function and call.function.arguments:
                num_argument_deltas += 1
            calls[call.index]["arguments"] += (call.function and call.function.arguments) or ""
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "tool_calls" and calls
    assert num_argument_deltas > len(calls)  # the arguments arrived in pieces, as they formed
    for call in calls.values():
        _valid_call(call["name"], call["arguments"])


def test_a_tool_result_renders_in_the_next_turn_and_none_calls_nothing(client: openai.OpenAI) -> None:
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=TOOLS, tool_choice="none",  # type: ignore[arg-type]
                                            max_tokens=8, temperature=0)
    choice = answer.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")
