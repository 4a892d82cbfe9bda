"""Turning OpenAI requests into worker requests: pure functions, checked without a server."""

from __future__ import annotations

from typing import Any

import pydantic
import pytest

from dynserve.errors import InvalidRequestError
from dynserve.gateway.errors import validation_error
from dynserve.gateway.preprocess import prepare_chat, prepare_completion
from dynserve.gateway.schemas import ChatCompletionRequest, CompletionRequest

MODEL = "m"


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 **fields})


def test_text_parts_and_developer_role_render_like_plain_messages(tokenizer: Any) -> None:
    parts = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
    ]})
    plain = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello\nthere"}]})
    assert prepare_chat(parts, tokenizer, 8192).prompts == prepare_chat(plain, tokenizer, 8192).prompts


def test_defaults_fill_the_context_and_map_every_parameter(tokenizer: Any) -> None:
    prepared = prepare_chat(chat(temperature=0.5, top_p=0.9, top_k=5, stop="END", seed=3, presence_penalty=0.1,
                                 frequency_penalty=0.2, logprobs=True, top_logprobs=2), tokenizer, 8192)
    (params,) = prepared.params
    assert params.max_tokens == 8192 - len(prepared.prompts[0])
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.5, 0.9, 5, 3)
    assert (params.stop, params.logprobs, params.presence_penalty, params.frequency_penalty) == (
        ("END",), 2, 0.1, 0.2)
    assert prepare_chat(chat(max_completion_tokens=7, max_tokens=99), tokenizer, 8192).params[0].max_tokens == 7


def test_n_seeded_choices_get_distinct_seeds(tokenizer: Any) -> None:
    seeds = [p.seed for p in prepare_chat(chat(n=3, seed=10), tokenizer, 8192).params]
    assert seeds == [10, 11, 12]
    assert [p.seed for p in prepare_chat(chat(n=2), tokenizer, 8192).params] == [None, None]


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": []}, "tools"), ({"tool_choice": "auto"}, "tool_choice"), ({"functions": []}, "functions"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"), ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"modalities": ["audio"]}, "modalities"), ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"top_logprobs": 2}, "top_logprobs"), ({"max_tokens": 9000}, "max_tokens"),
    ({"no_stop_trim": True}, "no_stop_trim"), ({"skip_special_tokens": False}, "skip_special_tokens"),
    ({"return_hidden_states": True}, "return_hidden_states"),
    ({"continue_final_message": True}, "continue_final_message"),
])
def test_unsupported_or_inconsistent_parameters_are_named(tokenizer: Any, fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        prepare_chat(chat(**fields), tokenizer, 8192)
    assert info.value.param == param


def test_accepted_no_op_fields_pass(tokenizer: Any) -> None:
    prepare_chat(chat(response_format={"type": "text"}, modalities=["text"], store=False, metadata={"a": "b"},
                      user="u", service_tier="auto"), tokenizer, 8192)
    # what sglang-router adds to every request it forwards: SGLang's extensions at their defaults
    prepare_chat(chat(no_stop_trim=False, skip_special_tokens=True, return_hidden_states=False,
                      continue_final_message=False, separate_reasoning=True, stream_reasoning=False), tokenizer, 8192)


def test_non_text_parts_are_rejected_by_position(tokenizer: Any) -> None:
    request = ChatCompletionRequest.model_validate({"model": MODEL, "messages": [
        {"role": "user", "content": "a"},
        {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "input_audio", "input_audio": {}}]}]})
    with pytest.raises(InvalidRequestError) as info:
        prepare_chat(request, tokenizer, 8192)
    assert info.value.param == "messages[1].content[1]"


def test_completion_prompt_forms(tokenizer: Any) -> None:
    ids = tokenizer.encode("Hello world")
    for prompt, expected in [("Hello world", [ids]), (ids, [ids]), (["Hello world", "Hi"], [ids, tokenizer.encode("Hi")]),
                             ([ids, ids[:1]], [ids, ids[:1]])]:
        request = CompletionRequest.model_validate({"model": MODEL, "prompt": prompt, "max_tokens": 4})
        assert prepare_completion(request, tokenizer, 8192).prompts == expected
    for prompt in ([], [10**6], "", [-1], [1, tokenizer.vocab_size], [[1], [2, -3]]):
        with pytest.raises((InvalidRequestError, pydantic.ValidationError)):
            prepare_completion(CompletionRequest.model_validate({"model": MODEL, "prompt": prompt}), tokenizer, 8192)
    both_ends = [0, tokenizer.vocab_size - 1]
    request = CompletionRequest.model_validate({"model": MODEL, "prompt": both_ends, "max_tokens": 4})
    assert prepare_completion(request, tokenizer, 8192).prompts == [both_ends]


def test_context_length_error_code(tokenizer: Any) -> None:
    request = CompletionRequest.model_validate({"model": MODEL, "prompt": list(range(20, 120)), "max_tokens": 30})
    with pytest.raises(InvalidRequestError) as info:
        prepare_completion(request, tokenizer, 128)
    assert info.value.code == "context_length_exceeded" and info.value.param == "max_tokens"
    with pytest.raises(InvalidRequestError) as info:
        prepare_completion(CompletionRequest.model_validate({"model": MODEL, "prompt": list(range(20, 148))}),
                           tokenizer, 128)
    assert info.value.code == "context_length_exceeded" and info.value.param == "prompt"


@pytest.mark.parametrize(("body", "param", "needle"), [
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "frobnicate": 1}', "frobnicate",
     "Unrecognized request argument"),
    (b'{"model": "m", "messages": [{"role": "robot", "content": "x"}]}', "messages[0].role", "role"),
    (b'{"model": "m", "messages": []}', "messages", "messages"),
    (b'{"model": "m"', None, "parse the JSON"),
    (b"[1, 2]", None, "JSON object"),
    # integers are bounded exactly, never through a float that rounds 2**63 down to the bound
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": 9223372036854775808}', "seed",
     "less than or equal to 9223372036854775807"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": -9223372036854775809}', "seed",
     "greater than or equal to -9223372036854775808"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": 9.3e18}', "seed",
     "less than or equal"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "x"}], "seed": true}', "seed", "valid integer"),
])
def test_validation_errors_become_openai_errors(body: bytes, param: str | None, needle: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        ChatCompletionRequest.model_validate_json(body)
    error = validation_error(info.value.errors())
    assert error.status == 400 and error.param == param and needle in error.message
