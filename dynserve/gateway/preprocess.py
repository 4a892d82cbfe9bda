"""From a validated OpenAI request to what workers run: prompt token ids and one `SamplingParams` per choice.

Pure functions of (request, tokenizer, model limits). Everything the user got wrong surfaces here as an
`InvalidRequestError` naming the parameter, before any worker is involved:
- a field OpenAI defines that dynserve does not implement (functions, audio, ...);
- an output constraint (`response_format`, `structured_outputs`) that is malformed or does not compile
  (`structured.py`), and tools, a tool choice or a tool's schema likewise (`tools.py`);
- a content part that is not text;
- a prompt plus `max_tokens` longer than the context (`code="context_length_exceeded"`).

`max_tokens` left out means what it means at OpenAI: for a chat, the rest of the context; for a legacy text
completion, 16 tokens (`COMPLETION_DEFAULT_MAX_TOKENS`), so a careless request cannot hold a worker until
the context is full.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dynserve.errors import InvalidRequestError, TokenizerError
from dynserve.gateway.schemas import ChatCompletionRequest, CompletionRequest, _SamplingFields
from dynserve.gateway.structured import grammar_of
from dynserve.gateway.tool_formats import ToolCallParser, ToolFormat, select_tool_format
from dynserve.gateway.tools import ToolPlan, call_grammar, render_messages, tool_plan_of
from dynserve.model.tokenizer import Tokenizer, ids_in_vocab
from dynserve.protocol import Grammar, SamplingParams

__all__ = ["COMPLETION_DEFAULT_MAX_TOKENS", "Prepared", "prepare_chat", "prepare_completion", "reject_unsupported"]

# OpenAI's (and vLLM's) default for /v1/completions; a chat's default is what the prompt leaves of the context
COMPLETION_DEFAULT_MAX_TOKENS = 16

_UNSUPPORTED = (
    "functions", "function_call", "modalities", "audio", "prediction", "reasoning_effort", "web_search_options",
    "verbosity",
)
# SGLang extension fields and the one value of each that describes what dynserve does
_SGLANG_DEFAULTS = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False,
                    "continue_final_message": False}


@dataclass(frozen=True, slots=True)
class Prepared:
    """`prompts[p]` runs with `params[i]` for the choices `p * n + i`; `tools`: the chat's tool plan, whose
    calls its answers are parsed for, in `tool_format`."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    tools: ToolPlan | None = None
    tool_format: ToolFormat | None = None

    def tool_call_parser(self) -> ToolCallParser | None:
        """A fresh parser for one choice's answer; None without tools. A forced call streams its arguments
        as they form (the grammar guarantees it parses)."""
        if self.tools is None or self.tool_format is None:
            return None
        return ToolCallParser(self.tool_format, stream_arguments=self.tools.forced)

    @property
    def n(self) -> int:
        return len(self.params)


def reject_unsupported(request: _SamplingFields) -> None:
    # a field the body left out has its default, which every check here accepts: only given ones are read
    # (reading all of them cost 20 us a request)
    given = request.model_fields_set
    for name in _UNSUPPORTED:
        if name not in given:
            continue
        value = getattr(request, name)
        if value is None or (name == "modalities" and value == ["text"]):
            continue
        raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)
    if request.logit_bias:
        raise InvalidRequestError("'logit_bias' is not supported by this server", param="logit_bias")
    for name, served in _SGLANG_DEFAULTS.items():
        if name in given and getattr(request, name, served) != served:
            raise InvalidRequestError(f"'{name}': only {str(served).lower()} is supported by this server", param=name)
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError("stream_options is only allowed when stream is true", param="stream_options")


def prepare_chat(request: ChatCompletionRequest, tokenizer: Tokenizer, max_model_len: int,
                 tool_format: ToolFormat | None = None) -> Prepared:
    """`tool_format`: how the model writes tool calls (default: `select_tool_format` of the tokenizer)."""
    reject_unsupported(request)
    messages = []
    for i, message in enumerate(request.messages):
        content = message.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise InvalidRequestError(
                        f"content parts of type {part.type!r} are not supported; send text parts",
                        param=f"messages[{i}].content[{j}]",
                    )
            content = [{"type": "text", "text": part.text} for part in content]
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if message.tool_calls:
            entry["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry)
    tools = tool_plan_of(request)
    if tool_format is None:
        tool_format = select_tool_format(tokenizer)
    rendered, tools_arg = render_messages(messages, tools, tool_format, tokenizer.chat_template_renders_tools)
    try:
        text = tokenizer.apply_chat_template(rendered, tools=tools_arg)
    except TokenizerError as exc:
        raise InvalidRequestError(str(exc), param="messages") from exc
    prompt = tokenizer.encode(text)
    if request.top_logprobs is not None and not request.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    logprobs = (request.top_logprobs or 0) if request.logprobs else None
    max_tokens = request.max_completion_tokens or request.max_tokens
    params = _sampling_params(request, len(prompt), max_model_len, max_tokens, logprobs, "messages",
                              tokenizer.end_of_generation_ids - {tokenizer.eos_token_id},
                              call_grammar(tools, tool_format) if tools is not None else None)
    return Prepared([prompt], params, tools, tool_format)


def prepare_completion(request: CompletionRequest, tokenizer: Tokenizer, max_model_len: int) -> Prepared:
    reject_unsupported(request)
    if request.echo:
        raise InvalidRequestError("'echo' is not supported by this server", param="echo")
    if request.suffix:
        raise InvalidRequestError("'suffix' is not supported by this server", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise InvalidRequestError("best_of other than n is not supported", param="best_of")
    for name in ("tools", "tool_choice", "parallel_tool_calls"):
        if getattr(request, name) is not None:
            raise InvalidRequestError(f"'{name}' is served on /v1/chat/completions only", param=name)
    raw = request.prompt
    if not raw:
        raise InvalidRequestError("prompt is empty", param="prompt")
    if isinstance(raw, str):
        prompts = [tokenizer.encode(raw)]
    elif raw and isinstance(raw[0], int):
        prompts = [list(raw)]  # type: ignore[arg-type]
    elif raw and isinstance(raw[0], str):
        prompts = [tokenizer.encode(text) for text in raw]  # type: ignore[arg-type]
    else:
        prompts = [list(ids) for ids in raw]  # type: ignore[union-attr]
    vocab = tokenizer.vocab_size
    for ids in prompts:
        if not ids:
            raise InvalidRequestError("prompt is empty", param="prompt")
        if not ids_in_vocab(ids, vocab):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
    longest = max(len(p) for p in prompts)
    # one parameter set for all prompts; the default fits what the longest prompt leaves of the context
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, max_model_len - longest)
    params = _sampling_params(request, longest, max_model_len, max_tokens, request.logprobs, "prompt",
                              tokenizer.end_of_generation_ids - {tokenizer.eos_token_id})
    return Prepared(prompts, params)


def _sampling_params(
    request: _SamplingFields, prompt_len: int, max_model_len: int, max_tokens: int | None,
    logprobs: int | None, prompt_param: str, end_ids: frozenset[int], tool_grammar: Grammar | None = None,
) -> list[SamplingParams]:
    """`end_ids`: the model's other ends of generation besides its EOS (Gemma's `<end_of_turn>`, ...); like
    the EOS, the request stops at them unless it asks to ignore EOS. `tool_grammar`: the calls a required or
    named `tool_choice` must make."""
    if prompt_len >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, your {prompt_param} "
            f"resulted in {prompt_len} tokens. Please reduce the length of the {prompt_param}.",
            param=prompt_param, code="context_length_exceeded",
        )
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the {prompt_param}, {max_tokens} in the "
            "completion). Please reduce the length of the prompt or of the completion.",
            param="max_tokens", code="context_length_exceeded",
        )
    stop = (request.stop,) if isinstance(request.stop, str) else tuple(request.stop or ())
    base = SamplingParams(
        max_tokens=max_tokens if max_tokens is not None else max_model_len - prompt_len,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        seed=request.seed,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        stop=stop,
        stop_token_ids=(*(request.stop_token_ids or ()), *(() if request.ignore_eos else sorted(end_ids))),
        ignore_eos=request.ignore_eos,
        logprobs=logprobs,
        grammar=_one_grammar(grammar_of(request), tool_grammar),
    )
    base.validate()
    if request.n == 1:
        return [base]
    import msgspec

    # each choice its own seed, so n seeded choices differ from each other and reproduce across calls
    return [base if request.seed is None else msgspec.structs.replace(base, seed=request.seed + i)
            for i in range(request.n)]


def _one_grammar(output: Grammar | None, tool_calls: Grammar | None) -> Grammar | None:
    if output is not None and tool_calls is not None:
        raise InvalidRequestError("a required or named tool_choice cannot be combined with an output constraint",
                                  param="tool_choice")
    return output or tool_calls
