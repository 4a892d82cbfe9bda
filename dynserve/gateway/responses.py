"""OpenAI response bodies and stream chunks, built from token deltas.

Chat and text completions differ only in a handful of field names, so one `ResponseBuilder` per request
knows which it is making. Chunks are encoded with msgspec straight to SSE bytes (`data: {...}\\n\\n`), the
stream ends with `data: [DONE]`, exactly as OpenAI streams; with `stream_options.include_usage` every
chunk carries `"usage": null` and a last chunk with empty `choices` carries the usage. With
`continuous_usage_stats` too (vLLM's extension), each chunk of text or of a finish carries the usage so far
instead of null. A chat with tools has its answer parsed as it arrives (`tool_formats.ToolCallParser`): its text streams
until a call could begin, its calls as `delta.tool_calls` (a forced call's arguments as they form, any other
call whole once it closes); a whole answer's calls are `message.tool_calls`; either way an answer that called
a tool ends with finish_reason "tool_calls".
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from dynserve.gateway.tool_formats import ToolCallParser
from dynserve.model.tokenizer import Tokenizer
from dynserve.protocol import TokenDelta, TokenLogprob

__all__ = ["ChoiceState", "ResponseBuilder", "sse"]

_JSON = msgspec.json.Encoder()
DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + _JSON.encode(payload) + b"\n\n"


@dataclass(slots=True)
class ChoiceState:
    index: int
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    finish_reason: str | None = None
    text_offset: int = 0
    tool_calls: ToolCallParser | None = None  # a chat with tools: its answer is parsed for calls
    contents: list[str] = field(default_factory=list)  # with tools: the answer's text that is not calls
    # with tools: what the last absorbed delta gave, to stream (content, `delta.tool_calls` entries)
    pending: tuple[str, list[dict[str, Any]]] = ("", [])

    def absorb(self, delta: TokenDelta) -> None:
        self.texts.append(delta.text)
        if self.tool_calls is not None:
            content, calls = self.tool_calls.push(delta.text, delta.token_ids)
            if delta.finished:
                rest, more = self.tool_calls.finish()
                content, calls = content + rest, calls + more
            self.contents.append(content)
            self.pending = (content, calls)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        self.num_prompt_tokens = delta.num_prompt_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.num_output_tokens = delta.num_output_tokens
        if delta.finished:
            self.finish_reason = delta.finish_reason


class ResponseBuilder:
    def __init__(self, kind: Literal["chat", "completion"], response_id: str, model: str, tokenizer: Tokenizer,
                 *, include_usage: bool, num_prompts: int, continuous_usage: bool = False) -> None:
        self.kind, self.id, self.model, self.tokenizer = kind, response_id, model, tokenizer
        self.created = int(time.time())
        self.include_usage = include_usage
        self.continuous_usage = include_usage and continuous_usage
        self.num_prompts = num_prompts
        self.object = "chat.completion" if kind == "chat" else "text_completion"
        self.chunk_object = "chat.completion.chunk" if kind == "chat" else "text_completion"

    # ---- streaming ------------------------------------------------------------------------------------

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        payload: dict[str, Any] = {"id": self.id, "object": self.chunk_object, "created": self.created,
                                   "model": self.model, "choices": choices}
        if self.include_usage:
            payload["usage"] = usage
        return sse(payload)

    def role_chunk(self, index: int) -> bytes:
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def delta_chunks(self, state: ChoiceState, delta: TokenDelta,
                     usage: dict[str, Any] | None = None) -> list[bytes]:
        """The chunks for one (merged) delta: its text (and logprobs), then its finish reason if it ended;
        `usage` (the usage so far, with `continuous_usage`) goes in each."""
        out = []
        text, reason, calls = delta.text, delta.finish_reason, None
        if state.tool_calls is not None:
            (text, calls), state.pending = state.pending, ("", [])
            reason = "tool_calls" if state.tool_calls.calls and reason == "stop" else reason
        if text or delta.logprobs:
            logprobs = self._logprobs(delta.logprobs or [], state) if delta.logprobs else None
            if self.kind == "chat":
                choice = {"index": state.index, "delta": {"content": text}, "logprobs": logprobs,
                          "finish_reason": None}
            else:
                choice = {"index": state.index, "text": text, "logprobs": logprobs, "finish_reason": None}
            out.append(self._chunk([choice], usage))
        state.text_offset += len(delta.text)
        if calls:
            out.append(self._chunk([{"index": state.index, "delta": {"tool_calls": calls}, "logprobs": None,
                                     "finish_reason": None}], usage))
        if delta.finished:
            if self.kind == "chat":
                choice = {"index": state.index, "delta": {}, "logprobs": None, "finish_reason": reason}
            else:
                choice = {"index": state.index, "text": "", "logprobs": None, "finish_reason": delta.finish_reason}
            out.append(self._chunk([choice], usage))
        return out

    def usage_chunk(self, states: list[ChoiceState]) -> bytes:
        return sse({"id": self.id, "object": self.chunk_object, "created": self.created, "model": self.model,
                    "choices": [], "usage": self.usage(states)})

    # ---- whole responses ------------------------------------------------------------------------------

    def full_response(self, states: list[ChoiceState]) -> dict[str, Any]:
        choices = []
        for state in states:
            text = "".join(state.texts)
            logprobs = self._logprobs(state.logprobs, ChoiceState(state.index)) if state.logprobs else None
            if self.kind == "chat":
                message: dict[str, Any] = {"role": "assistant", "content": text}
                reason = state.finish_reason
                if state.tool_calls is not None and state.tool_calls.calls:
                    content = "".join(state.contents)
                    message = {"role": "assistant", "content": content or None, "tool_calls": state.tool_calls.calls}
                    reason = "tool_calls" if reason == "stop" else reason
                choices.append({"index": state.index, "message": message, "logprobs": logprobs,
                                "finish_reason": reason})
            else:
                choices.append({"index": state.index, "text": text, "logprobs": logprobs,
                                "finish_reason": state.finish_reason})
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage(states)}

    def first_per_prompt(self, states: list[ChoiceState]) -> list[ChoiceState]:
        """One choice of each prompt: the prompt's tokens count once, not once per choice."""
        return states[:: max(1, len(states) // self.num_prompts)]

    def usage(self, states: list[ChoiceState]) -> dict[str, Any]:
        """Prompt tokens count once per prompt (not per choice), as OpenAI counts them."""
        firsts = self.first_per_prompt(states)
        prompt_tokens = sum(s.num_prompt_tokens for s in firsts)
        completion_tokens = sum(s.num_output_tokens for s in states)
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(s.num_cached_tokens for s in firsts)}}

    # ---- logprobs -------------------------------------------------------------------------------------

    def _logprobs(self, logprobs: list[TokenLogprob], state: ChoiceState) -> dict[str, Any]:
        tok = self.tokenizer
        if self.kind == "chat":
            return {"content": [
                {"token": tok.token_to_str(lp.token_id), "logprob": lp.logprob,
                 "bytes": list(tok.token_bytes(lp.token_id)),
                 "top_logprobs": [{"token": tok.token_to_str(t), "logprob": v, "bytes": list(tok.token_bytes(t))}
                                  for t, v in lp.top]}
                for lp in logprobs
            ]}
        tokens = [tok.token_to_str(lp.token_id) for lp in logprobs]
        offsets, offset = [], state.text_offset
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in logprobs],
                "top_logprobs": [{tok.token_to_str(t): v for t, v in lp.top} for lp in logprobs],
                "text_offset": offsets}
