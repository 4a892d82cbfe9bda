"""Tool-call formats (Hermes, Llama 3 JSON, Mistral): which one a model gets, how its template renders tools,
earlier calls and results, that a forced call always parses and matches its schema, and how calls stream.

The model families' published chat templates come from llama.cpp's collection (scripts/llama-vocab.sh
extracts them from the llama-cpp-python sdist); each renders here exactly as `transformers` renders it. The
forced calls are drawn from the grammar's allowed tokens at random (SmolLM2's vocabulary), with no model:
what makes a call valid is the grammar, and the random draw explores it harder than a model would.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from dynserve.gateway.preprocess import prepare_chat
from dynserve.gateway.schemas import ChatCompletionRequest
from dynserve.gateway.tool_formats import FORMATS, ToolCallParser, select_tool_format
from dynserve.gateway.tools import render_messages, tool_plan_of

TEMPLATES = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "dynserve" / "llama-templates" / "0.3.36"
FAMILIES = {  # template file -> the format it selects
    "Qwen-Qwen2.5-7B-Instruct": "hermes",
    "Qwen-Qwen3-0.6B": "hermes",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3_json",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral",
}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "hourly": {"type": "boolean"},
    "fields": {"type": "array", "items": {"enum": ["wind", "rain"]}, "maxItems": 2}},
    "required": ["city", "unit"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}/[A-Z][a-z]{1,8}$"}},
        "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now", "parameters": WEATHER,
                                           "strict": True}},
         {"type": "function", "function": {"name": "get_time", "description": "Time now", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}


def _with_template(tokenizer: Any, name: str) -> Any:
    path = TEMPLATES / f"{name}.jinja"
    if not path.exists():
        pytest.fail(f"{path} is missing: run scripts/llama-vocab.sh (make setup does)")
    other = copy.copy(tokenizer)
    for cached in ("_compiled_chat_template", "chat_template_renders_tools"):
        other.__dict__.pop(cached, None)
    other.chat_template = path.read_text("utf-8")
    return other


def _chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", **fields})


# ---- which format, and how tools render ---------------------------------------------------------------


@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_each_family_gets_its_format_from_its_template(tokenizer: Any, template: str) -> None:
    assert select_tool_format(_with_template(tokenizer, template)).name == FAMILIES[template]
    assert _with_template(tokenizer, template).chat_template_renders_tools


def test_a_template_without_tools_gets_hermes_and_the_flag_overrides(tokenizer: Any) -> None:
    assert not tokenizer.chat_template_renders_tools  # SmolLM2's ChatML
    assert select_tool_format(tokenizer).name == "hermes"
    assert select_tool_format(tokenizer, "mistral").name == "mistral"
    assert select_tool_format(tokenizer, "mistral").marker_token_id is None  # no such token: written as text
    with pytest.raises(ValueError, match="unknown tool-call parser 'frob'"):
        select_tool_format(tokenizer, "frob")


def _conversation(call_id: str, num_calls: int) -> list[dict[str, Any]]:
    calls = [{"id": call_id if i == 0 else f"{call_id[:-1]}9", "type": "function",
              "function": {"name": "get_weather", "arguments": json.dumps({"city": f"Rome{i}", "unit": "celsius"})}}
             for i in range(num_calls)]
    results = [{"role": "tool", "tool_call_id": call["id"], "content": f"{20 + i} degrees"}
               for i, call in enumerate(calls)]
    return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Rome?"},
            {"role": "assistant", "content": None, "tool_calls": calls}, *results]


@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_a_templates_own_tools_section_renders_as_transformers_renders_it(tokenizer: Any, template: str) -> None:
    from transformers.utils.chat_template_utils import render_jinja_template

    model = _with_template(tokenizer, template)
    num_calls = 1 if FAMILIES[template] == "llama3_json" else 2  # Llama 3's template takes one call a turn
    messages = _conversation("abcDEF123", num_calls)
    plan = tool_plan_of(_chat(messages=messages, tools=TOOLS))
    rendered, tools = render_messages(messages, plan, select_tool_format(model), native=True)
    ours = model.apply_chat_template(rendered, tools=tools)
    expected_messages = copy.deepcopy(messages)
    for message in expected_messages:  # transformers' convention: a call's arguments as an object, text content
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        message["content"] = message["content"] or ""
    special = {name: model.decode([token_id], skip_special_tokens=False)
               for name, token_id in (("bos_token", model.bos_token_id), ("eos_token", model.eos_token_id))}
    [expected] = render_jinja_template([expected_messages], tools=TOOLS, chat_template=model.chat_template,
                                       add_generation_prompt=True, **special)[0]
    assert ours == expected
    assert ours.count('"get_weather"') == num_calls + 1 and all(f"{20 + i} degrees" in ours for i in range(num_calls))
    # and the gateway's prompt is that text's tokens
    assert prepare_chat(_chat(messages=messages, tools=TOOLS), model, 8192).prompts[0] == model.encode(ours)


def test_mistral_ids_are_mapped_alike_for_a_call_and_its_result(tokenizer: Any) -> None:
    model = _with_template(tokenizer, "mistralai-Mistral-Nemo-Instruct-2407")
    messages = _conversation("call_0123456789abcdef", 1)  # not nine letters and digits: the template refuses it
    prompt = model.decode(prepare_chat(_chat(messages=messages, tools=TOOLS), model, 8192).prompts[0])
    [call_id] = {part.split('"')[0] for part in prompt.split('"id": "')[1:]}
    assert len(call_id) == 9 and call_id.isalnum() and f'"call_id": "{call_id}"' in prompt


def test_default_rendering_writes_earlier_calls_in_the_formats_syntax(tokenizer: Any) -> None:
    for name, written in (("hermes", '<tool_call>\n{"name": "get_weather", "arguments": '),
                          ("llama3_json", '{"name": "get_weather", "parameters": '),
                          ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ')):
        prepared = prepare_chat(_chat(messages=_conversation("call_1", 1), tools=TOOLS), tokenizer, 8192,
                                FORMATS[name])
        prompt = tokenizer.decode(prepared.prompts[0])
        assert written in prompt and "<tool_response>\n20 degrees\n</tool_response>" in prompt
        assert '"name": "get_time"' in prompt  # the tools, in the system message


# ---- forced calls: always parse, always match ----------------------------------------------------------


def _draw(tokenizer: Any, grammar: Any, rng: random.Random, max_tokens: int = 400) -> list[int]:
    """Tokens the grammar allows, drawn at random until it is complete (the step cap is a test failure)."""
    from dynserve.engine.structured import GrammarState

    state = GrammarState.start(grammar, tokenizer)
    ends = tokenizer.end_of_generation_ids
    out: list[int] = []
    for _ in range(max_tokens):
        allowed = [int(t) for t in state.allowed_token_ids()]
        if any(t in ends for t in allowed) and rng.random() < 0.5:
            return out  # the grammar may end here (after a call, with more allowed): end it half the time
        allowed = [t for t in allowed if t not in ends]
        if not allowed:
            return out
        # prefer short tokens now and then, so strings close and arrays end
        token = rng.choice(allowed) if rng.random() < 0.5 else min(rng.sample(allowed, min(8, len(allowed))),
                                                                    key=lambda t: len(tokenizer.token_bytes(t)))
        assert state.accept(token)
        out.append(token)
        if state.is_done:
            return out
    pytest.fail(f"no complete answer in {max_tokens} tokens")


def _stream(parser: ToolCallParser, tokenizer: Any, token_ids: list[int], rng: random.Random
            ) -> tuple[str, list[dict[str, Any]]]:
    """Feed the answer in random-sized pieces, as deltas arrive; the content sent and the call deltas."""
    detok = tokenizer.detokenizer()
    content, deltas, i = [], [], 0
    while i < len(token_ids):
        piece = token_ids[i:i + rng.randint(1, 4)]
        i += len(piece)
        text, calls = parser.push("".join(detok.push(t) for t in piece), piece)
        content.append(text)
        deltas.extend(calls)
    text, calls = parser.finish()
    return "".join(content) + text, deltas + calls


def _joined(deltas: list[dict[str, Any]]) -> dict[int, dict[str, str]]:
    calls: dict[int, dict[str, str]] = {}
    for delta in deltas:
        if "id" in delta:
            calls[delta["index"]] = {"id": delta["id"], "name": delta["function"]["name"], "arguments": ""}
        calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    return calls


@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("choice", ["required", "get_time"])
def test_forced_calls_always_parse_and_match_their_schemas(tokenizer: Any, name: str, choice: str) -> None:
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    prepared = prepare_chat(_chat(messages=[{"role": "user", "content": "go"}], tools=TOOLS,
                                  tool_choice=tool_choice), tokenizer, 8192, FORMATS[name])
    grammar = prepared.params[0].grammar
    assert grammar is not None
    rng = random.Random(f"{name}-{choice}")
    num_parts = 0
    for _ in range(12):
        parser = prepared.tool_call_parser()
        assert parser is not None and parser.stream_arguments
        content, deltas = _stream(parser, tokenizer, _draw(tokenizer, grammar, rng), rng)
        assert content == "" and parser.calls
        assert len(parser.calls) == 1 or FORMATS[name].parallel
        streamed = _joined(deltas)
        assert [streamed[i] for i in range(len(streamed))] == [
            {"id": c["id"], **c["function"]} for c in parser.calls]  # the deltas add up to the calls
        num_parts += sum(1 for d in deltas if "id" not in d)
        for call in parser.calls:
            assert choice == "required" or call["function"]["name"] == choice
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])
            if name == "mistral":
                assert len(call["id"]) == 9 and call["id"].isalnum()
    assert num_parts > 24  # arguments stream in pieces as they form, not whole at the end


def test_llama3_answers_one_call_even_with_parallel_calls_on(tokenizer: Any) -> None:
    prepared = prepare_chat(_chat(messages=[{"role": "user", "content": "go"}], tools=TOOLS, tool_choice="required",
                                  parallel_tool_calls=True), tokenizer, 8192, FORMATS["llama3_json"])
    assert prepared.params[0].grammar is not None and "; " not in prepared.params[0].grammar.source.split("\n")[0]


# ---- free answers (`auto`): parsed, never half-sent --------------------------------------------------


def _feed(parser: ToolCallParser, text: str, size: int = 3, token_ids: tuple[int, ...] = ()) -> tuple[str, list]:
    content, deltas = [], []
    for i in range(0, len(text), size):
        piece, calls = parser.push(text[i:i + size], token_ids if i == 0 else ())
        content.append(piece)
        deltas.extend(calls)
    piece, calls = parser.finish()
    return "".join(content) + piece, deltas + calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), [
    ("hermes", 'Let me check. <tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/Rome"}}\n</tool_call>',
     "Let me check. ", [("get_time", {"zone": "Europe/Rome"})]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "b", '
     '"arguments": "{\\"x\\": 1}"}\n</tool_call>', "", [("a", {}), ("b", {"x": 1})]),
    ("hermes", "a < b <tool", "a < b <tool", []),
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    ("llama3_json", ' {"name": "get_time", "parameters": {"zone": "Asia/Tokyo"}}', "",
     [("get_time", {"zone": "Asia/Tokyo"})]),
    ("llama3_json", 'The answer is {"name": "x"}', 'The answer is {"name": "x"}', []),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {"k": [1, 2]}}, {"name": "b", "arguments": {}}]', "",
     [("a", {"k": [1, 2]}), ("b", {})]),
    ("mistral", "No tools needed [here].", "No tools needed [here].", []),
])
def test_free_answers_are_parsed_for_calls(name: str, text: str, content: str, calls: list) -> None:
    parser = ToolCallParser(FORMATS[name])
    sent, deltas = _feed(parser, text)
    assert sent == content
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parser.calls] == calls
    assert all("id" in d and d["function"]["arguments"] == c["function"]["arguments"]
               for d, c in zip(deltas, parser.calls, strict=True))  # each call went out whole, once


def test_mistrals_control_token_opens_the_calls_though_its_text_is_dropped() -> None:
    mistral = dataclasses.replace(FORMATS["mistral"], marker_token_id=5)
    parser = ToolCallParser(mistral)
    sent, _ = _feed(parser, '[{"name": "a", "arguments": {"k": 1}}]', token_ids=(5, 1032))
    assert sent == "" and parser.calls[0]["function"] == {"name": "a", "arguments": '{"k": 1}'}
    plain = ToolCallParser(mistral)
    assert _feed(plain, "[1, 2]")[0] == "[1, 2]" and not plain.calls  # no control token: text
    grammar = mistral.grammar_source([TOOLS[1]["function"]], True, True)
    assert grammar.startswith('start: <[5]> "["')
