"""Chat templates rendered exactly as `transformers`' `apply_chat_template(..., tokenize=False)` renders them:
a sandboxed Jinja environment with transformers' globals and `tojson`, and messages whose list-of-parts
content is joined into one string (text parts only: the engine is text-only).
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dynserve.errors import TokenizerError

__all__ = ["GEMMA_CHAT_TEMPLATE", "chat_template_variables", "compile_chat_template", "default_chat_template", "plain_message"]

# Gemma's turn format, for a Gemma GGUF that carries no template of its own (Gemma 3 270M's does not):
#   <bos><start_of_turn>user\n{system}\n\n{user}<end_of_turn>\n<start_of_turn>model\n{reply}<end_of_turn>\n
# Gemma has no system role: a system message goes in front of the first user message, a blank line between.
# Roles must alternate user / assistant after it; "assistant" is written "model"; contents are trimmed.
GEMMA_CHAT_TEMPLATE = """{{ bos_token }}
{%- set first = messages[0] if messages else none -%}
{%- set system = first['content'] | trim + '\n\n' if first and first['role'] == 'system' else '' -%}
{%- set turns = messages[1:] if system else messages -%}
{%- for message in turns -%}
  {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
    {{ raise_exception('Gemma needs the roles to alternate user/assistant/user/... after a system message') }}
  {%- endif -%}
  {{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}
  {{- (system if loop.first else '') + message['content'] | trim }}<end_of_turn>{{ '\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"""

# architectures (general.architecture) whose format is known, for GGUFs without tokenizer.chat_template
# (Gemma 1 and 2 write turns the same way; their GGUFs carry a template, and none here has been checked)
_DEFAULT_TEMPLATES = {"gemma3": GEMMA_CHAT_TEMPLATE}


def default_chat_template(architecture: str | None) -> str | None:
    """The chat template for a GGUF that has none, by its architecture: Gemma's turn format for Gemma 3,
    else None (such a model serves completions only and refuses chats, as before)."""
    return _DEFAULT_TEMPLATES.get(architecture or "")


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile the way transformers does: sandboxed, trim/lstrip blocks, its globals and `tojson`."""

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:  # unlike jinja's own tojson, no HTML escaping
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(date_format: str) -> str:
        return datetime.now().strftime(date_format)

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = strftime_now
    try:
        return environment.from_string(source)
    except jinja2.TemplateError as exc:
        raise TokenizerError(f"the chat template does not compile: {exc}") from exc


def chat_template_variables(source: str) -> frozenset[str]:
    """The variables a template reads from its context (`messages`, `tools`, `bos_token`, ...); none when it
    does not compile."""
    environment = ImmutableSandboxedEnvironment(extensions=[jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(environment.parse(source)))
    except jinja2.TemplateError:
        return frozenset()


def plain_message(message: Any, index: int) -> dict[str, Any]:
    """A copy of one chat message whose list-of-parts content is joined into one string.

    Text parts are joined with "\\n" (as vLLM does for string-content templates); other part types
    (images, audio) are rejected since the engine is text-only.
    """
    if not isinstance(message, dict) or "role" not in message:
        raise TokenizerError(f"message {index} must be a dict with a 'role', got {message!r}")
    content = message.get("content")
    if not isinstance(content, list):
        return dict(message)
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise TokenizerError(f"message {index}: only text content parts are supported, got {part!r}")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}
