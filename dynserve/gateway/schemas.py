"""OpenAI request schemas (pydantic, so FastAPI validates them and publishes them in /openapi.json).

Unknown fields are rejected (`extra="forbid"`), as OpenAI does, so a typo never silently changes behaviour.
Fields OpenAI defines that dynserve does not implement are declared here so they validate, and then
`preprocess.reject_unsupported` answers them with a 400 that names them. So are SGLang's extension fields that
sglang-router adds, at their defaults, to every request it forwards: those defaults ask for what dynserve
does, so they are accepted; any other value is a 400 naming the field. Responses are plain dicts built in
`responses.py` and encoded with msgspec (they are on the hot path and need no validation).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions", "TextPart"]

MAX_N = 16
MAX_STOP_SEQUENCES = 4


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(BaseModel):
    """A content part; only `type: "text"` is served (others are rejected by preprocessing, by name)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    refusal: str | None = None


class _SamplingFields(_Strict):
    model: str
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    top_k: Annotated[int, Field(ge=1, description="extension: keep the k most likely tokens")] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_SEQUENCES)] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="extension: keep generating past the end-of-text token")
    stop_token_ids: list[int] | None = Field(None, description="extension: extra token ids that end generation")
    # accepted and ignored: they change nothing about the completion
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # defined by OpenAI, not implemented by dynserve: a non-default value is a 400 naming the field
    logit_bias: dict[str, float] | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
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
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    # SGLang extensions, as above; the two reasoning switches do nothing without a reasoning parser (dynserve
    # has none), so any value is accepted
    continue_final_message: bool = Field(False, description="extension (SGLang): only false is served")
    separate_reasoning: bool = True
    stream_reasoning: bool = True


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | Annotated[list[str], Field(min_length=1)] | Annotated[
        list[list[int]], Field(min_length=1)
    ]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1)] | None = None
