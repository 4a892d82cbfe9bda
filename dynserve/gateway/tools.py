"""Tool calling: `tools`, `tool_choice` and `parallel_tool_calls` in, the prompt and the grammar out.

- Rendering (`render_messages`): a chat template with a tools section of its own (Qwen2.5, Qwen3, Llama 3.1,
  Mistral Nemo: `Tokenizer.chat_template_renders_tools`) gets the tools, earlier calls (their arguments as
  objects) and `tool` messages as it expects them (Mistral's ids as its nine letters and digits). Any other
  template gets plain messages: the tools described in the system message by the format's default section,
  earlier calls written in the format's syntax, and a tool result as a user turn holding
  `<tool_response>{content}</tool_response>`.
- Calls are written in the model family's format (`tool_formats.py`: Hermes, Llama 3 JSON, Mistral).
  `tool_choice: "required"` or a named function is enforced by a grammar (`call_grammar`): the answer is one
  call (or, with `parallel_tool_calls` and a format that allows it, one or more), each naming a given
  function with arguments that match its `parameters` schema. `auto` leaves the model free and parses the
  calls it writes; `none` renders no tools and parses nothing.

Pure functions of the request; every problem with the request is an `InvalidRequestError` naming the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from dynserve.errors import InvalidRequestError
from dynserve.gateway.structured import check_json_schema, checked_grammar
from dynserve.gateway.tool_formats import ToolFormat
from dynserve.protocol import Grammar

__all__ = ["ToolPlan", "call_grammar", "render_messages", "tool_plan_of"]

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


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


def call_grammar(plan: ToolPlan, tool_format: ToolFormat) -> Grammar | None:
    """The grammar a forced plan's answer keeps (None for `auto`): tool calls only, in `tool_format`'s syntax,
    each naming one of the allowed functions with arguments matching its schema (non-strict functions:
    keywords the engine cannot enforce are ignored)."""
    if not plan.forced:
        return None
    functions = [t["function"] for t in plan.tools if plan.choice in ("required", t["function"]["name"])]
    lenient = not all(f.get("strict") for f in functions)
    source = tool_format.grammar_source(functions, lenient, plan.parallel)
    return checked_grammar(Grammar(kind="lark", source=source), "tools")


def render_messages(messages: list[dict[str, Any]], plan: ToolPlan | None, tool_format: ToolFormat,
                    native: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and tools to give the chat template: as its own tools section expects them (`native`),
    or plain, with the tools in the system message and calls and results as text."""
    if native:
        return [_native_message(message, tool_format) for message in messages], (plan.tools if plan else None)
    out = []
    for message in messages:
        role, content = message["role"], _text(message.get("content"))
        if role == "assistant" and message.get("tool_calls"):
            calls = tool_format.call_text([(call["function"]["name"], _arguments(call))
                                           for call in message["tool_calls"]])
            content = f"{content}\n{calls}" if content else calls
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if plan is not None:
        section = tool_format.section.format(tools="\n".join(json.dumps(tool) for tool in plan.tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{section}"}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, None


def _native_message(message: dict[str, Any], tool_format: ToolFormat) -> dict[str, Any]:
    out = {**message, "content": _text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"id": tool_format.template_call_id(call["id"]), "type": "function",
                              "function": {"name": call["function"]["name"], "arguments": _arguments(call)}}
                             for call in message["tool_calls"]]
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = tool_format.template_call_id(message["tool_call_id"])
    return out


def _text(content: Any) -> str:
    if isinstance(content, list):  # text parts
        return "\n".join(part["text"] for part in content)
    return content or ""


def _arguments(call: dict[str, Any]) -> Any:
    """A call's arguments as an object (templates write them with `tojson`); as the client sent them when
    they are not JSON."""
    try:
        return json.loads(call["function"]["arguments"])
    except ValueError:
        return call["function"]["arguments"]
