"""A request's output constraint: OpenAI's `response_format` and vLLM's `structured_outputs` (and its older
`guided_*` fields) as the one `Grammar` workers enforce.

- `response_format`: `text` (no constraint), `json_object` (any JSON object), `json_schema` (`schema` checked
  against its JSON Schema metaschema, then compiled; `strict: true` refuses keywords the engine cannot
  enforce, otherwise they are ignored and the rest is enforced).
- `structured_outputs` (vLLM): exactly one of `json` (a schema, as an object or JSON text), `json_object`,
  `regex`, `choice` (a list of strings: the output is one of them), `grammar` (Lark, llguidance's dialect).
  `guided_json`, `guided_regex`, `guided_choice` and `guided_grammar` are the same, by their older names.

Pure functions of the request; every problem is an `InvalidRequestError` naming the field and what is wrong
with it (a 400 in OpenAI's error shape), before any worker is involved. Compiled grammars are checked once per
distinct source (`_compile_error` keeps the recent ones).
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any

import jsonschema
import llguidance

from dynserve.errors import InvalidRequestError
from dynserve.protocol import Grammar

__all__ = ["check_json_schema", "checked_grammar", "grammar_of"]

_VLLM_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_SOURCE_CHARS = 200_000  # a schema, regex or grammar longer than this is refused (compiling it holds a worker)


def grammar_of(request: Any) -> Grammar | None:
    """The grammar `request`'s fields ask for (None: unconstrained); InvalidRequestError for a bad one or
    for two constraints at once."""
    given = request.model_fields_set
    found: list[tuple[str, Grammar]] = []
    if "response_format" in given and request.response_format is not None:
        grammar = _response_format(request.response_format)
        if grammar is not None:
            found.append(("response_format", grammar))
    if "structured_outputs" in given and request.structured_outputs is not None:
        found.append(("structured_outputs", _structured_outputs(request.structured_outputs)))
    for name, kind in _GUIDED.items():
        if name in given and getattr(request, name) is not None:
            found.append((name, _vllm_constraint(kind, getattr(request, name), name)))
    if len(found) > 1:
        names = ", ".join(f"'{name}'" for name, _ in found)
        raise InvalidRequestError(f"only one output constraint per request: {names} were given", param=found[1][0])
    return found[0][1] if found else None


def _response_format(value: Any) -> Grammar | None:
    param = "response_format"
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise InvalidRequestError("response_format must be an object with a 'type'", param=param)
    kind = value["type"]
    _only_keys(value, {"type", "json_schema"} if kind == "json_schema" else {"type"}, param)
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar(kind="json_schema", source='{"type": "object"}')
    if kind != "json_schema":
        raise InvalidRequestError(f"response_format type {kind!r} is not supported; use text, json_object or "
                                  "json_schema", param="response_format.type")
    spec = value.get("json_schema")
    param = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise InvalidRequestError("response_format.json_schema must be an object with 'name' and 'schema'",
                                  param=param)
    _only_keys(spec, {"name", "description", "schema", "strict"}, param)
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise InvalidRequestError("response_format.json_schema.name must be 1 to 64 letters, digits, '_' or '-'",
                                  param=f"{param}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequestError("response_format.json_schema.strict must be a boolean", param=f"{param}.strict")
    if "schema" not in spec:
        raise InvalidRequestError("response_format.json_schema.schema is missing", param=f"{param}.schema")
    return _schema_grammar(spec["schema"], f"{param}.schema", lenient=not strict)


def _structured_outputs(value: Any) -> Grammar:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise InvalidRequestError("structured_outputs must be an object", param=param)
    unknown = sorted(set(value) - set(_VLLM_KINDS))
    if unknown:
        raise InvalidRequestError(f"'structured_outputs.{unknown[0]}' is not supported by this server; give one "
                                  f"of {', '.join(_VLLM_KINDS)}", param=f"{param}.{unknown[0]}")
    kinds = [kind for kind in _VLLM_KINDS if value.get(kind) not in (None, False)]
    if len(kinds) != 1:
        raise InvalidRequestError(f"structured_outputs must give exactly one of {', '.join(_VLLM_KINDS)}",
                                  param=param)
    return _vllm_constraint(kinds[0], value[kinds[0]], f"{param}.{kinds[0]}")


def _vllm_constraint(kind: str, value: Any, param: str) -> Grammar:
    if kind == "json_object":
        if value is not True:
            raise InvalidRequestError(f"{param} must be true", param=param)
        return Grammar(kind="json_schema", source='{"type": "object"}')
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise InvalidRequestError(f"{param} is not valid JSON: {exc}", param=param) from exc
        return _schema_grammar(value, param, lenient=False)
    if kind == "choice":
        if (not isinstance(value, list) or not value
                or not all(isinstance(choice, str) and choice for choice in value)):
            raise InvalidRequestError(f"{param} must be a non-empty list of non-empty strings", param=param)
        # Lark string literals take JSON's escapes: each choice is matched exactly
        source = "start: " + " | ".join(json.dumps(choice) for choice in value)
        return checked_grammar(Grammar(kind="lark", source=source), param)
    if not isinstance(value, str) or not value:
        raise InvalidRequestError(f"{param} must be a non-empty string", param=param)
    return checked_grammar(Grammar(kind="regex" if kind == "regex" else "lark", source=value), param)


def check_json_schema(schema: Any, param: str) -> None:
    """InvalidRequestError naming `param` unless `schema` is an object valid against its metaschema (the
    draft its `$schema` names, 2020-12 by default)."""
    if not isinstance(schema, dict):
        raise InvalidRequestError(f"{param} must be a JSON Schema object", param=param)
    # checked once per distinct schema: a large one (100 kB) takes the metaschema check 0.3-0.7 s here
    problem = _schema_problem(json.dumps(schema, sort_keys=True, separators=(",", ":")))
    if problem:
        raise InvalidRequestError(f"{param} is not a valid JSON Schema: {problem}", param=param)


@functools.lru_cache(maxsize=256)
def _schema_problem(source: str) -> str:
    """What is wrong with a schema (JSON text) against its metaschema; "" when nothing is."""
    schema = json.loads(source)
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return f"at {exc.json_path if exc.path else 'its root'}: {exc.message}"
    return ""


def _schema_grammar(schema: Any, param: str, *, lenient: bool) -> Grammar:
    check_json_schema(schema, param)
    return checked_grammar(Grammar(kind="json_schema", source=json.dumps(schema, separators=(",", ":")), lenient=lenient),
                    param)


def checked_grammar(grammar: Grammar, param: str) -> Grammar:
    """`grammar`, once it is known to compile (InvalidRequestError naming `param` and the problem if not)."""
    if len(grammar.source) > MAX_SOURCE_CHARS:
        raise InvalidRequestError(f"{param} is longer than {MAX_SOURCE_CHARS} characters", param=param)
    error = _compile_error(grammar.kind, grammar.source, grammar.lenient)
    if error:
        what = {"json_schema": "schema", "regex": "regular expression", "lark": "grammar"}[grammar.kind]
        raise InvalidRequestError(f"{param}: the {what} cannot be enforced: {error}", param=param)
    return grammar


@functools.lru_cache(maxsize=256)
def _compile_error(kind: str, source: str, lenient: bool) -> str:
    """llguidance's complaint about a grammar ("" when it compiles); the engine compiles it the same way."""
    if kind == "json_schema":
        compiled = llguidance.LLMatcher.grammar_from_json_schema(source, overrides={"lenient": lenient})
    elif kind == "regex":
        compiled = llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(source, 'd')}/")
    else:
        compiled = llguidance.LLMatcher.grammar_from_lark(source)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(compiled)
    return messages[0] if is_error else ""


def _only_keys(value: dict[str, Any], allowed: set[str], param: str) -> None:
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise InvalidRequestError(f"'{param}.{unknown[0]}' is not supported by this server", param=f"{param}.{unknown[0]}")
