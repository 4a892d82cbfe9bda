"""The schema-validity corpus: real-world JSON Schemas and our own, as structured-output requests send them.

Real-world: the SchemaStore schemas the `check-jsonschema` package vendors (CI configurations, compose files,
issue forms, ...), each whole file that the server accepts under `strict`, and from every file the first
`definitions_per_file` of its definitions that describe an object of two or more properties (a real part of
a real schema: the file with its root pointing at that definition). Ours: `tests/fixtures/schemas/*.json`,
covering `$ref` (recursive too), `anyOf`, `allOf`, enums and consts, patterns, formats, nested arrays,
numeric bounds and tuples.

A schema is sent `bounded`: wherever it leaves a string's length, an array's length or an object's keys
open, a bound is added (`maxLength`, `maxItems`, `additionalProperties: false`, pattern-named keys left out).
Only constraints are added, outside `not` and `if`, so every document valid under the bounded schema is
valid under the original: an answer is checked against both (`check_answer`). The bounds are there because
a mocker draws uniformly among the tokens a grammar allows, and a string whose every token is allowed
closes only when a quote happens to be drawn; a model closes its strings itself.

Which schemas are used is decided by the server's own checks (the metaschema, then llguidance with
`strict`): one it refuses is left out with its reason in `Corpus.skipped`, never silently.

Invariants: the corpus is the same on every run (files in sorted order, definitions in file order); a
schema's `name` is unique (`schemastore:<file>`, `schemastore:<file>#<definition>`, `own:<file>`).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import jsonschema

__all__ = ["OWN_SCHEMAS_DIR", "Corpus", "CorpusSchema", "bounded", "check_answer", "load_corpus"]

OWN_SCHEMAS_DIR = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "schemas"
MAX_STRING_CHARS = 12  # a string with neither a length nor an enum nor a fixed-size format
MAX_PATTERN_CHARS = 24  # a string with a pattern (or a free-size format): room for what the pattern asks
MAX_ITEMS = 3
# larger files are left out: the gateway checks a schema against its metaschema on every request (0.3-0.7 s
# for the 120-190 kB ones)
MAX_SCHEMA_CHARS = 100_000
_SCALARS = ("null", "boolean", "number", "string")  # what a schema that says nothing of a value is bounded to
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                          "writeOnly", "markdownDescription", "$id", "id", "$schema", "$anchor"})
_SHAPING = frozenset({"type", "$ref", "$dynamicRef", "enum", "const", "anyOf", "oneOf", "allOf", "not", "if"})
_OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties", "patternProperties"})
_FIXED_SIZE_FORMATS = frozenset({"date", "uuid", "ipv4", "ipv6"})  # (a time's fraction of a second is not)
# keywords whose value is a schema, a list of schemas, or a map of name to schema (draft-04 to 2020-12);
# `not`, `if`, `then`, `else` are absent: a constraint added under them could widen what the whole allows
_SUBSCHEMA = ("items", "additionalItems", "additionalProperties", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "definitions", "$defs", "dependentSchemas")


@dataclass(frozen=True, slots=True)
class CorpusSchema:
    """One schema of the corpus: `original` as published, `sent` as requests carry it (`bounded`)."""

    name: str
    original: dict[str, Any]
    sent: dict[str, Any]


@dataclass(slots=True)
class Corpus:
    schemas: list[CorpusSchema] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why the server refuses it

    def count(self, prefix: str) -> int:
        return sum(schema.name.startswith(prefix) for schema in self.schemas)


def bounded(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of `schema` whose instances are all instances of `schema`, with every string, array and
    object of bounded size (see the module's docstring)."""
    out = copy.deepcopy(schema)
    _bound(out)
    return out


def _bound(node: Any) -> None:
    if not isinstance(node, dict):
        return
    for key in _SUBSCHEMA:
        _bound(node.get(key))
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for sub in node[key]:
                _bound(sub)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for sub in node[key].values():
                _bound(sub)
    if "$ref" in node:  # draft-07 ignores a $ref's siblings: a bound there would bind nothing
        return
    if node.keys() <= _ANNOTATIONS:  # nothing says what it is: any JSON value
        node["type"] = list(_SCALARS)
    elif not _SHAPING & node.keys() and _OBJECT_KEYWORDS & node.keys():  # an object's keywords, any type
        node["type"] = "object"
    types = node.get("type")
    types = types if isinstance(types, list) else [types]
    if "string" in types and not {"maxLength", "enum", "const"} & node.keys():
        if node.get("format") not in _FIXED_SIZE_FORMATS:
            room = MAX_PATTERN_CHARS if "pattern" in node or "format" in node else MAX_STRING_CHARS
            node["maxLength"] = max(room, node.get("minLength", 0))
    if "array" in types:
        if "maxItems" not in node:
            node["maxItems"] = max(MAX_ITEMS, node.get("minItems", 0))
        if isinstance(node.get("items"), list):  # a draft-07 tuple: nothing after it
            node.setdefault("additionalItems", False)
        elif "items" not in node:  # a 2020-12 tuple: nothing after it; else scalars
            node["items"] = False if "prefixItems" in node else {"type": list(_SCALARS), "maxLength": MAX_STRING_CHARS}
    if "object" in types and ("properties" in node or not node.get("required")):  # (keys required but not
        node.pop("patternProperties", None)  # listed: an allOf's part, whose keys another part lists)
        node["additionalProperties"] = False


def check_answer(text: str, schema: CorpusSchema) -> str | None:
    """None when `text` is one JSON document valid under the schema as published and as sent (formats
    checked too, where jsonschema has a checker for them); else what is wrong."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        return f"not JSON: {exc}"
    for which, candidate in (("original", schema.original), ("sent", schema.sent)):
        validator = jsonschema.validators.validator_for(candidate, default=jsonschema.Draft202012Validator)
        error = jsonschema.exceptions.best_match(
            validator(candidate, format_checker=validator.FORMAT_CHECKER).iter_errors(document))
        if error is not None:
            return f"invalid under the {which} schema at {error.json_path}: {error.message}"
    return None


def load_corpus(definitions_per_file: int = 2) -> Corpus:
    """The corpus (see the module's docstring); needs the `check-jsonschema` package (a dev dependency)."""
    corpus = Corpus()
    vendor = resources.files("check_jsonschema.builtin_schemas.vendor")
    for path in sorted((p for p in vendor.iterdir() if p.name.endswith(".json")), key=lambda p: p.name):
        published = json.loads(path.read_text(encoding="utf-8"))
        stem = path.name.removesuffix(".json")
        size_chars = len(json.dumps(published, separators=(",", ":")))
        if size_chars > MAX_SCHEMA_CHARS:
            corpus.skipped[f"schemastore:{stem}"] = f"{size_chars} characters, over the corpus's {MAX_SCHEMA_CHARS}"
            continue
        _add(corpus, f"schemastore:{stem}", published)
        for name, definition in _definitions(published):
            if corpus.count(f"schemastore:{stem}#") >= definitions_per_file:
                break
            if len(definition.get("properties") or {}) >= 2:
                _add(corpus, f"schemastore:{stem}#{name}", _rooted_at(published, name))
    for path in sorted(OWN_SCHEMAS_DIR.glob("*.json")):
        _add(corpus, f"own:{path.stem}", json.loads(path.read_text(encoding="utf-8")))
    return corpus


def _definitions(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    key = "$defs" if "$defs" in schema else "definitions"
    return [(name, sub) for name, sub in (schema.get(key) or {}).items() if isinstance(sub, dict)]


def _rooted_at(schema: dict[str, Any], name: str) -> dict[str, Any]:
    """`schema`'s definitions (and its identity, which its references resolve against), its root being
    definition `name`."""
    key = "$defs" if "$defs" in schema else "definitions"
    kept = {k: schema[k] for k in ("$schema", "$id", "id") if k in schema}
    return {**kept, key: schema[key], "$ref": f"#/{key}/{name}"}


def _add(corpus: Corpus, name: str, original: dict[str, Any]) -> None:
    from dynserve.errors import InvalidRequestError
    from dynserve.gateway.structured import check_json_schema, checked_grammar
    from dynserve.protocol import Grammar

    sent = bounded(original)
    try:  # the gateway's checks of a strict json_schema, the quickest first (the metaschema's takes 0.1-1 s
        # on a large file, the compiler refuses most of those first)
        checked_grammar(Grammar(kind="json_schema", source=json.dumps(sent), lenient=False), name)
        check_json_schema(sent, name)
    except InvalidRequestError as exc:
        reason = str(exc).splitlines()[0].removeprefix(f"{name}: ")
        corpus.skipped[name] = reason if len(reason) <= 160 else f"{reason[:160]}..."
        return
    corpus.schemas.append(CorpusSchema(name, original, sent))
