"""Tool calling: `tools`, `tool_choice` and `parallel_tool_calls` in, `tool_calls` out, Hermes style.

- Rendering: the model's chat template receives plain messages. The tools are described in the system
  message by a default section (`TOOLS_SECTION`: each function's JSON inside `<tools></tools>`, and the call
  format); an assistant turn's earlier calls render as `<tool_call>` blocks in its content, and a `tool`
  message as a user turn holding `<tool_response>{content}</tool_response>`. (Templates with their own tools
  section, such as Qwen's, are not yet given the tools: the tokenizer's `apply_chat_template` has no `tools`
  argument today; they get the same default section.)
- Output: a call is `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`. `tool_choice: "required"`
  or a named function is enforced by a grammar (`call_grammar`): the answer is one call (or, with
  `parallel_tool_calls`, one or more), each naming a given function with arguments that match its
  `parameters` schema. `auto` leaves the model free and parses the calls it writes (`ToolCallParser`);
  `none` renders no tools and parses nothing.
- Streaming (`ToolCallParser.push`): text is streamed until a `<tool_call>` could begin; what follows is held
  and, once the answer ends, sent as `delta.tool_calls` (id, name, whole arguments), with
  `finish_reason: "tool_calls"`.

Pure functions of the request and of the text; every problem with the request is an `InvalidRequestError`
naming the field.
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from dynserve.errors import InvalidRequestError
from dynserve.gateway.structured import checked_grammar, check_json_schema
from dynserve.protocol import Grammar

__all__ = ["TOOLS_SECTION", "ToolCallParser", "ToolPlan", "call_grammar", "render_messages", "tool_plan_of"]

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOLS_SECTION = (
    "# Tools\n\nYou can call functions to answer. Their signatures are inside <tools></tools>:\n<tools>\n"
    "{tools}\n</tools>\n\nTo call one, answer with its name and JSON arguments inside <tool_call></tool_call>:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n</tool_call>"
)
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
# JSON as the engine writes it under a grammar (see engine/structured.py's JSON_OPTIONS)
_JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A request's tools (each `{"type": "function", "function": {...}}`), which it may or must call
    (`choice`: "auto", "required", or a function's name), and whether it may call several at once."""

    tools: list[dict[str, Any]]
    choice: str
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice != "auto"


def tool_plan_of(request: Any) -> ToolPlan | None:
    """The request's tool plan; None without tools or with `tool_choice: "none"`."""
    given = request.model_fields_set
    tools = request.tools if "tools" in given else None
    choice = request.tool_choice if "tool_choice" in given else None
    parallel = request.parallel_tool_calls if "parallel_tool_calls" in given else None
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls must be a boolean", param="parallel_tool_calls")
    if tools is None:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools must be a non-empty list of functions", param="tools")
    names = [_check_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools name a function twice", param="tools")
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        if not isinstance(function, dict) or set(choice) != {"type", "function"} or set(function) != {"name"}:
            raise InvalidRequestError("tool_choice must be none, auto, required or "
                                      "{'type': 'function', 'function': {'name': ...}}", param="tool_choice")
        choice = function["name"]
        if choice not in names:
            raise InvalidRequestError(f"tool_choice names {choice!r}, which is not among the tools",
                                      param="tool_choice")
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequestError("tool_choice must be none, auto, required or a function", param="tool_choice")
    if choice == "none":
        return None
    return ToolPlan(tools, choice, parallel is not False)


def _check_tool(tool: Any, param: str) -> str:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequestError(f"{param} must be {{'type': 'function', 'function': {{...}}}}", param=param)
    if set(tool) != {"type", "function"}:
        raise InvalidRequestError(f"{param}: only type and function are supported", param=param)
    function = tool["function"]
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise InvalidRequestError(f"'{param}.function.{unknown[0]}' is not supported", param=f"{param}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidRequestError(f"{param}.function.name must be 1 to 64 letters, digits, '_' or '-'",
                                  param=f"{param}.function.name")
    if "description" in function and not isinstance(function["description"], str):
        raise InvalidRequestError(f"{param}.function.description must be a string",
                                  param=f"{param}.function.description")
    if "parameters" in function:
        check_json_schema(function["parameters"], f"{param}.function.parameters")
    return name


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


def call_grammar(plan: ToolPlan) -> Grammar | None:
    """The grammar a forced plan's answer keeps (None for `auto`): tool calls only, each naming one of the
    allowed functions with arguments matching its schema (non-strict functions: keywords the engine cannot
    enforce are ignored)."""
    if not plan.forced:
        return None
    functions = [t["function"] for t in plan.tools if plan.choice in ("required", t["function"]["name"])]
    lenient = not all(f.get("strict") for f in functions)
    schema = {"x-guidance": {**_JSON_STYLE, "lenient": lenient}, "anyOf": [
        {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
         "required": ["name", "arguments"], "additionalProperties": False} for f in functions]}
    repeat = ' ("\\n" call)*' if plan.parallel else ""
    source = (f"start: call{repeat}\ncall: {json.dumps(CALL_OPEN + chr(10))} body {json.dumps(chr(10) + CALL_CLOSE)}\n"
              f"body: %json {json.dumps(schema)}")
    return checked_grammar(Grammar(kind="lark", source=source), "tools")


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan | None) -> list[dict[str, Any]]:
    """Plain messages for the chat template: tool calls and results as text, the tools in the system message."""
    out = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if isinstance(content, list):  # text parts
            content = "\n".join(part["text"] for part in content)
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(f"{CALL_OPEN}\n{_call_json(call)}\n{CALL_CLOSE}" for call in message["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if plan is not None:
        section = TOOLS_SECTION.format(tools="\n".join(json.dumps(tool) for tool in plan.tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _call_json(call: dict[str, Any]) -> str:
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        arguments = function["arguments"]  # as the client sent it
    return json.dumps({"name": function["name"], "arguments": arguments})


@dataclass(slots=True)
class ToolCallParser:
    """One choice's output under a tool plan: the text to stream now, the calls at the end."""

    held: str = ""  # text not yet sent: a possible start of a call, or every call once one began
    in_calls: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)

    def push(self, text: str) -> str:
        """Add generated text; return the part that is plain content and safe to send now."""
        self.held += text
        if self.in_calls:
            return ""
        start = self.held.find(CALL_OPEN)
        if start >= 0:
            out, self.held, self.in_calls = self.held[:start], self.held[start:], True
            return out
        keep = next((n for n in range(min(len(CALL_OPEN) - 1, len(self.held)), 0, -1)
                     if self.held.endswith(CALL_OPEN[:n])), 0)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(out):]
        return out

    def finish(self) -> str:
        """The answer ended: parse the held calls into `calls`; return the content still to send (text that
        was held, and what is not a well-formed call)."""
        held, self.held = self.held, ""
        if not self.in_calls:
            return held
        rest, last = [], 0
        for match in _CALL.finditer(held):
            call = _parse_call(match.group(1))
            if call is None:
                continue
            rest.append(held[last:match.start()])
            last = match.end()
            self.calls.append(call)
        rest.append(held[last:])
        return "".join(rest).strip() if self.calls else held


def _parse_call(body: str) -> dict[str, Any] | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": value["name"], "arguments": json.dumps(arguments)}}
