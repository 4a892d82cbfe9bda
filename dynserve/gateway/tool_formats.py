"""How a model family writes tool calls: its call syntax, the grammar that forces it, and the parser that reads it.

Three formats, each a `ToolFormat`:

| format | a call | several calls | where calls begin |
|---|---|---|---|
| `hermes` (Qwen2.5, Qwen3, Hermes; the default) | `<tool_call>\\n{"name": f, "arguments": {...}}\\n</tool_call>` | one block each, a newline between | at `<tool_call>`, after any text |
| `llama3_json` (Llama 3.1 to 3.3) | `{"name": f, "parameters": {...}}` | one call per answer (Llama 3's template refuses more) | only when the answer starts with `{` |
| `mistral` (Mistral, Mixtral, Nemo) | `[TOOL_CALLS][{"name": f, "arguments": {...}}]` | the list holds several | at `[TOOL_CALLS]` (a control token: seen in the token ids) |

`select_tool_format` picks one from the chat template (its own tool-call syntax, or its vocabulary's
`[TOOL_CALLS]`) unless a name is given (`--tool-call-parser`).

`ToolCallParser` reads one choice's output as it streams: text is sent as content until calls could begin;
after that, each call object is scanned as its characters arrive. With `stream_arguments` (the call is forced
by a grammar, so it cannot fail to parse) a call's id and name go out as soon as the name is whole and its
arguments as they form (partial JSON); otherwise (`tool_choice: auto`, where the model may write a malformed
call) each call goes out whole when its object closes and parses, so nothing sent is ever taken back. Text
after the calls begin that is not a call (a malformed one included) is returned as content when the answer
ends. The concatenated `arguments` deltas of a call are its `arguments` string in the whole response.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dynserve.model.tokenizer import Tokenizer

__all__ = ["FORMATS", "ToolCallParser", "ToolFormat", "select_tool_format"]

# JSON as the engine writes it under a grammar (see engine/structured.py's JSON_OPTIONS)
JSON_STYLE = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_ID_CHARS = string.ascii_letters + string.digits
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


@dataclass(frozen=True, slots=True)
class ToolFormat:
    """One family's call syntax. `marker`: the text that opens the calls (None: calls only when the answer
    starts with `{`); `marker_token_id`: the control token that writes it, when the vocabulary has one (the
    worker's detokenizer drops control tokens, so the parser looks for it in the token ids)."""

    name: str
    arguments_key: str
    marker: str | None
    parallel: bool
    section: str  # the default tools section of the system message: {tools} is each tool's JSON, one a line
    marker_token_id: int | None = None

    def new_call_id(self) -> str:
        if self.name == "mistral":  # Mistral's template accepts 9 letters and digits
            return "".join(secrets.choice(_ID_CHARS) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"

    def template_call_id(self, call_id: str) -> str:
        """A call id as the chat template takes it: Mistral's only nine letters and digits, so any other id
        maps to one, the same way for a call and for its result."""
        if self.name != "mistral" or _MISTRAL_ID.fullmatch(call_id):
            return call_id
        number = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        chars = []
        for _ in range(9):
            number, digit = divmod(number, len(_ID_CHARS))
            chars.append(_ID_CHARS[digit])
        return "".join(chars)

    def call_text(self, calls: list[tuple[str, Any]]) -> str:
        """Earlier calls `(name, arguments)` as this format writes them (for templates without a tools section)."""
        objects = [json.dumps({"name": name, self.arguments_key: arguments}) for name, arguments in calls]
        if self.name == "hermes":
            return "\n".join(f"<tool_call>\n{obj}\n</tool_call>" for obj in objects)
        if self.name == "mistral":
            return f"[TOOL_CALLS][{', '.join(objects)}]"
        return "; ".join(objects)

    def grammar_source(self, functions: list[dict[str, Any]], lenient: bool, parallel: bool) -> str:
        """The Lark grammar (llguidance's dialect) of an answer that is only calls, each naming one of
        `functions` with arguments that match its `parameters`."""
        schema = {"x-guidance": {**JSON_STYLE, "lenient": lenient}, "anyOf": [
            {"type": "object", "properties": {"name": {"const": f["name"]}, self.arguments_key: _parameters(f)},
             "required": ["name", self.arguments_key], "additionalProperties": False} for f in functions]}
        body = f"body: %json {json.dumps(schema)}"
        several = parallel and self.parallel
        if self.name == "hermes":
            more = ' ("\\n" call)*' if several else ""
            return f'start: call{more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\n{body}'
        if self.name == "mistral":
            marker = f"<[{self.marker_token_id}]>" if self.marker_token_id is not None else json.dumps(self.marker)
            more = ' (", " body)*' if several else ""
            return f'start: {marker} "[" body{more} "]"\n{body}'
        return f"start: body\n{body}"


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or {"type": "object", "properties": {}}


FORMATS = {
    "hermes": ToolFormat(
        "hermes", "arguments", "<tool_call>", True,
        "# Tools\n\nYou can call functions to answer. Their signatures are inside <tools></tools>:\n<tools>\n"
        "{tools}\n</tools>\n\nTo call one, answer with its name and JSON arguments inside "
        "<tool_call></tool_call>:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}"
        "\n</tool_call>"),
    "llama3_json": ToolFormat(
        "llama3_json", "parameters", None, False,
        "# Tools\n\nYou can call one function to answer. Their signatures:\n{tools}\n\nTo call one, answer with "
        "only a JSON object: {{\"name\": <function-name>, \"parameters\": <arguments-object>}}"),
    "mistral": ToolFormat(
        "mistral", "arguments", "[TOOL_CALLS]", True,
        "# Tools\n\nYou can call functions to answer. Their signatures:\n{tools}\n\nTo call them, answer with "
        "[TOOL_CALLS] and a JSON list of calls: [TOOL_CALLS][{{\"name\": <function-name>, \"arguments\": "
        "<arguments-object>}}]"),
}


def select_tool_format(tokenizer: Tokenizer, name: str = "auto") -> ToolFormat:
    """The format `name` names, or (`auto`) the one the model's chat template and vocabulary show: `hermes`
    when the template writes `<tool_call>`, `mistral` when it or the vocabulary has `[TOOL_CALLS]`,
    `llama3_json` when the template has Llama 3's `ipython` role, else `hermes`. ValueError for an unknown
    name."""
    template = tokenizer.chat_template or ""
    marker_id = tokenizer.token_id_of("[TOOL_CALLS]")
    if name == "auto":
        if "<tool_call>" in template:
            name = "hermes"
        elif "[TOOL_CALLS]" in template or marker_id is not None:
            name = "mistral"
        elif "ipython" in template or "<|python_tag|>" in template:
            name = "llama3_json"
        else:
            name = "hermes"
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}: choose auto, {', '.join(FORMATS)}")
    chosen = FORMATS[name]
    if name == "mistral" and marker_id is not None and marker_id in tokenizer.special_token_ids:
        return ToolFormat(chosen.name, chosen.arguments_key, chosen.marker, chosen.parallel, chosen.section,
                          marker_id)
    return chosen


# a call object's beginning: its name, then the arguments' key (the grammar writes them in this order)
_HEADER = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_SEPARATORS = re.compile(r"</?tool_call>|\[TOOL_CALLS\]|[\[\],;\s]")


@dataclass(slots=True)
class _Scan:
    """The call object being read: its text so far and the JSON scanner's state."""

    text: str = ""
    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    arguments_at: int | None = None  # where the arguments object starts in `text`, once the header is whole
    arguments_end: int | None = None  # just past the arguments' closing bracket, once it came
    call_id: str | None = None  # set when the call's id and name went out before its end
    whole: bool = False  # the call goes out whole when it closes (its arguments are not an object)
    sent_to: int = 0  # how much of `text` went out as argument deltas


@dataclass(slots=True)
class ToolCallParser:
    """One choice's output under a tool plan; see the module's docstring."""

    format: ToolFormat
    stream_arguments: bool = False
    calls: list[dict[str, Any]] = field(default_factory=list)  # whole calls, in order
    _held: str = ""  # text not yet sent: a possible start of the calls, or the start of the answer
    _in_calls: bool = False
    _scan: _Scan | None = None
    _other: list[str] = field(default_factory=list)  # text among the calls that is not a call
    _no_calls: bool = False  # a format whose calls start the answer, and this answer did not

    def push(self, text: str, token_ids: list[int] | tuple[int, ...] = ()) -> tuple[str, list[dict[str, Any]]]:
        """Add generated text (and the tokens that made it); return the content safe to send now and the
        `delta.tool_calls` entries that are ready."""
        deltas: list[dict[str, Any]] = []
        if self._no_calls:
            return text, deltas
        if self._in_calls:
            self._feed(text, deltas)
            return "", deltas
        if self.format.marker_token_id is not None and self.format.marker_token_id in token_ids:
            content, self._held = self._held, ""
            self._in_calls = True
            self._feed(text, deltas)
            return content, deltas
        self._held += text
        content = self._release()
        if self._in_calls:
            held, self._held = self._held, ""
            self._feed(held, deltas)
        return content, deltas

    def _release(self) -> str:
        """Content from `_held` that cannot be the start of the calls; enters the calls when they begin."""
        held, marker = self._held, self.format.marker
        if marker is None:  # calls only when the answer starts with `{`
            stripped = held.lstrip()
            if not stripped:
                return ""
            if stripped[0] == "{":
                self._in_calls = True
                return ""
            self._no_calls = True
            self._held = ""
            return held
        start = held.find(marker)
        if start >= 0:
            self._held, self._in_calls = held[start + len(marker):], True
            return held[:start]
        keep = next((n for n in range(min(len(marker) - 1, len(held)), 0, -1) if held.endswith(marker[:n])), 0)
        self._held = held[len(held) - keep:]
        return held[: len(held) - keep]

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The answer ended: the content still to send (held text, text that is not a call, an unfinished
        call) and the last call deltas."""
        held, self._held = self._held, ""
        if not self._in_calls:
            return held, []
        if self._scan is not None:  # cut off inside a call
            self._other.append(self._scan.text)
            self._scan = None
        other = "".join(self._other)
        if not self.calls:  # no call after all: the answer is text
            return (self.format.marker or "") + other, []
        return (other.strip() if _SEPARATORS.sub("", other) else ""), []

    # ---- the calls -------------------------------------------------------------------------------------

    def _feed(self, text: str, deltas: list[dict[str, Any]]) -> None:
        for char in text:
            scan = self._scan
            if scan is None:
                if char == "{":
                    self._scan = scan = _Scan()
                else:
                    self._other.append(char)
                    continue
            self._advance(scan, char)
            if scan.depth == 0:
                self._close(scan, deltas)
                self._scan = None
            elif self.stream_arguments:
                self._stream(scan, deltas)

    @staticmethod
    def _advance(scan: _Scan, char: str) -> None:
        scan.text += char
        if scan.in_string:
            if scan.escaped:
                scan.escaped = False
            elif char == "\\":
                scan.escaped = True
            elif char == '"':
                scan.in_string = False
            return
        if char == '"':
            scan.in_string = True
        elif char in "{[":
            scan.depth += 1
        elif char in "}]":
            scan.depth -= 1
            if scan.depth == 1 and scan.arguments_at is not None and scan.arguments_end is None:
                scan.arguments_end = len(scan.text)
        if scan.depth == 1 and scan.arguments_at is None and not scan.in_string:
            header = _HEADER.fullmatch(scan.text)
            if header is not None:
                scan.arguments_at = len(scan.text)

    def _stream(self, scan: _Scan, deltas: list[dict[str, Any]]) -> None:
        """Send the current call's id and name once the header is whole, then its arguments as they form."""
        if scan.arguments_at is None or len(scan.text) <= scan.arguments_at:
            return
        if scan.call_id is None:
            header = _HEADER.fullmatch(scan.text[: scan.arguments_at])
            value = scan.text[scan.arguments_at:].lstrip()
            if not value or scan.whole:
                return
            if value[0] != "{":
                scan.whole = True  # arguments that are not an object: the call goes out whole at its end
                return
            scan.arguments_at = len(scan.text) - len(value)
            assert header is not None
            scan.call_id, scan.sent_to = self.format.new_call_id(), scan.arguments_at
            deltas.append({"index": len(self.calls), "id": scan.call_id, "type": "function",
                           "function": {"name": json.loads(header.group(1)), "arguments": ""}})
        end = len(scan.text) if scan.arguments_end is None else scan.arguments_end  # then the object's close
        if end > scan.sent_to:
            deltas.append({"index": len(self.calls), "function": {"arguments": scan.text[scan.sent_to:end]}})
            scan.sent_to = end

    def _close(self, scan: _Scan, deltas: list[dict[str, Any]]) -> None:
        call = _parse_call(scan.text, self.format.arguments_key)
        if call is None:
            self._other.append(scan.text)
            return
        name, arguments = call
        if scan.call_id is not None:
            self._stream(scan, deltas)  # whatever of the arguments is still unsent
            call_id, arguments_text = scan.call_id, scan.text[scan.arguments_at:scan.arguments_end]
        else:
            call_id = self.format.new_call_id()
            arguments_text = json.dumps(arguments)
            deltas.append({"index": len(self.calls), "id": call_id, "type": "function",
                           "function": {"name": name, "arguments": arguments_text}})
        self.calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments_text}})


def _parse_call(text: str, arguments_key: str) -> tuple[str, Any] | None:
    """(name, arguments) of one call object; None when it is not one."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", value.get("parameters", {})))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return value["name"], arguments

