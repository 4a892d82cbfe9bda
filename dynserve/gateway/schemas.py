"""OpenAI request schemas (pydantic, so FastAPI validates them and publishes them in /openapi.json).

Unknown fields are rejected (`extra="forbid"`), as OpenAI does, so a typo never silently changes behaviour;
values are not coerced across JSON types (`strict`): `1` is not `true`, nor `"2"` a number.
Fields OpenAI defines that dynserve does not implement are declared here so they validate, and then
`preprocess.reject_unsupported` answers them with a 400 that names them. So are SGLang's extension fields that
sglang-router adds, at their defaults, to every request it forwards: those defaults ask for what dynserve
does, so they are accepted; any other value is a 400 naming the field. Responses are plain dicts built in
`responses.py` and encoded with msgspec (they are on the hot path and need no validation); the response
models at the end of this module only describe them in the OpenAPI document (`tests/test_fuzz.py` checks
the server's answers against it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

__all__ = ["ChatCompletionRequest", "ChatCompletionResponse", "ChatMessage", "CompletionRequest", "CompletionResponse",
           "ErrorResponse", "StreamOptions", "TextPart", "ToolCall"]

MAX_N = 16


def _integer(ge: int, le: int) -> Callable[[Any], int]:
    """The JSON number as the integer it is (`5` or `5.0`; never `true`, `"5"` nor `5.5`), within [ge, le]
    compared exactly: a JSON integer is checked as parsed, never through a float (which rounds: 2**63 would
    pass a float bound of 2**63 - 1, and -2**63 - 1 become -2**63)."""

    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("Input should be a valid integer")
        if isinstance(value, float) and not (math.isfinite(value) and value.is_integer()):
            raise ValueError("Input should be a valid integer")
        number = int(value)
        if number > le:
            raise ValueError(f"Input should be less than or equal to {le}")
        if number < ge:
            raise ValueError(f"Input should be greater than or equal to {ge}")
        return number

    return check


def _int(ge: int | None = None, le: int | None = None, description: str | None = None) -> Any:
    """An integer as JSON Schema means it: `5` or `5.0`, never `true` nor `"5"` (the models are strict), and
    bounded: integers reaching the workers fit the wire's 64 bits, so a larger one is a 400, not a 500."""
    ge = -(2**63) if ge is None else ge
    le = 2**63 - 1 if le is None else le
    return Annotated[Any, AfterValidator(_integer(ge, le)),
                     WithJsonSchema({"type": "integer", "minimum": ge, "maximum": le}
                                    | ({"description": description} if description else {}))]


_TokenId = _int(0, 2**31 - 1)
MAX_STOP_SEQUENCES = 4


class _Strict(BaseModel):
    # strict types too: `false` is not a token id nor `0.0` a boolean (the fuzzer found both accepted)
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    """A content part; only `type: "text"` is served (others are rejected by preprocessing, by name)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ToolCallFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    """A call an assistant turn made (sent back in a conversation's history)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant turn's calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")


class _SamplingFields(_Strict):
    model: str
    max_tokens: _int(1) | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: _int(1, 2**31 - 1, "extension: keep the k most likely tokens") | None = None
    n: _int(1, MAX_N) = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: _int() | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-text token")
    stop_token_ids: list[_TokenId] | None = Field(None, description="extension: extra token ids that end generation")
    max_generation_s: Annotated[float, Field(gt=0, allow_inf_nan=False)] | None = Field(
        None, description="extension: stop generating after this many seconds (from admission), ending with "
        "finish_reason 'length'; the server's own cap (max_generation_s, 600 by default) applies when this is "
        "left out, and bounds it when it is larger")
    # accepted and ignored: they change nothing about the completion
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # structured output (`structured.py` reads and checks them): OpenAI's response_format, vLLM's extensions
    response_format: Any = Field(None, description="text, json_object, or json_schema (name, schema, strict)")
    structured_outputs: Any = Field(None, description="extension (vLLM): one of json, json_object, regex, "
                                    "choice, grammar (Lark)")
    guided_json: Any = Field(None, description="extension (vLLM, older name): structured_outputs.json")
    guided_regex: Any = Field(None, description="extension (vLLM, older name): structured_outputs.regex")
    guided_choice: Any = Field(None, description="extension (vLLM, older name): structured_outputs.choice")
    guided_grammar: Any = Field(None, description="extension (vLLM, older name): structured_outputs.grammar")
    # tool calling (`tools.py` reads and checks them; Hermes-style calls)
    tools: Any = Field(None, description="functions the model may call: {type: function, function: {name, "
                       "description, parameters, strict}}")
    tool_choice: Any = Field(None, description="none, auto, required, or {type: function, function: {name}}")
    parallel_tool_calls: Any = Field(None, description="false: at most one call per answer")
    # defined by OpenAI, not implemented by dynserve: a non-default value is a 400 naming the field
    logit_bias: dict[str, float] | None = None
    functions: Any = None
    function_call: Any = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    # SGLang extensions (sglang-router sends them): the defaults are dynserve's behaviour, other values a 400
    no_stop_trim: bool = Field(False, description="extension (SGLang): false leaves a matched stop string out")
    skip_special_tokens: bool = Field(True, description="extension (SGLang): true leaves control tokens out "
                                      "of the text")
    return_hidden_states: bool = Field(False, description="extension (SGLang): only false is served")


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: _int(1) | None = None
    logprobs: bool = False
    top_logprobs: _int(0, 20) | None = None
    # SGLang extensions, as above; the two reasoning switches do nothing without a reasoning parser (dynserve
    # has none), so any value is accepted
    continue_final_message: bool = Field(False, description="extension (SGLang): only false is served")
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class CompletionRequest(_SamplingFields):
    # empty prompts are refused by the schema (and so documented); token ids past the vocabulary by preprocessing
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[_TokenId], Field(min_length=1)]
             | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
             | Annotated[list[Annotated[list[_TokenId], Field(min_length=1)]], Field(min_length=1)])
    logprobs: _int(0, 5) | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: _int(1) | None = None


# ---- responses, as the OpenAPI document describes them -------------------------------------------------------


class _PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: _PromptTokensDetails


class _AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None


class _ChatChoice(BaseModel):
    index: int
    message: _AssistantMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None = Field(description="stop, length (max_tokens, the context or the generation cap), "
                                      "tool_calls")


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[_ChatChoice]
    usage: Usage


class _CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None = Field(description="stop, length (max_tokens, the context or the generation cap)")


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[_CompletionChoice]
    usage: Usage


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, for every status the gateway answers with an error (`errors.py`)."""

    error: _ErrorDetail
