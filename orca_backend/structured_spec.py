"""A request's structured-output constraint (JSON schema, regex, choice, grammar) as plain data, and the
parser that takes it out of a client's `sampling_parameters`, whichever spelling it came in.

Plain Python on purpose: `SamplingParams` (imported by every layer, the torch-free Triton stub included)
holds a `StructuredOutputSpec`, and parsing errors are ValueErrors the frontend answers with INVALID_ARG
before the request reaches the engine. Compiling a spec needs xgrammar and the model's tokenizer, and
happens in the engine core (core/structured_output.py); a spec the parser accepts may still fail to
compile there (a malformed regex, an undefined grammar rule): that request then ends with finish reason
"invalid".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

StructuredOutputKind = Literal["json", "json_object", "regex", "choice", "grammar"]
CONSTRAINT_KEYS: tuple[str, ...] = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's current name, Triton's vLLM backend's name up to 25.10 (a JSON string there), and the older
# top-level keys, each naming one constraint kind.
DICT_SPELLINGS = ("structured_outputs", "guided_decoding")
LEGACY_SPELLINGS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                    "guided_grammar": "grammar"}
# `backend` is accepted where it names what we run anyway (Triton's vLLM backend accepts these values).
ACCEPTED_BACKENDS = ("xgrammar", "xgrammar:no-fallback", "auto", "xgrammar:_auto")
# The other fields of vLLM's StructuredOutputsParams (current and older, GuidedDecodingParams): a client
# that serializes the dataclass whole (Triton's OpenAI frontend: json.dumps(asdict(params))) sends every
# one of them, null or false where unused.
BACKEND_KEYS = ("backend", "_backend")  # a backend name, or null
IGNORED_FLAGS = ("_backend_was_auto", "backend_was_auto", "disable_fallback")  # bookkeeping: no effect here
# xgrammar compiles JSON schemas in strict mode: properties a schema does not name are never generated,
# which is what disable_additional_properties asks for. Either value is accepted (vLLM's xgrammar
# backend ignores it too).
HONOURED_FLAGS = ("disable_any_whitespace", "disable_additional_properties")
UNSUPPORTED_OPTIONS = {
    "whitespace_pattern": "whitespace_pattern is not supported by this server's grammar engine (xgrammar); "
                          "leave it out, or send disable_any_whitespace=true for compact JSON",
    "structural_tag": "structural_tag is not supported; send one of json, regex, choice, grammar, json_object",
}
OPTION_KEYS = (*BACKEND_KEYS, *IGNORED_FLAGS, *HONOURED_FLAGS, *UNSUPPORTED_OPTIONS)
# xgrammar 0.2.8 compiles a string bounded by minLength/maxLength into a character class that admits raw
# control characters and no escapes, i.e. possibly invalid JSON (mlc-ai/xgrammar#800): refused.
UNSAFE_STRING_KEYWORDS = ("minLength", "maxLength")


@dataclass(frozen=True)
class StructuredOutputSpec:
    """One request's constraint. Frozen, so equal specs share one compiled grammar in the cache."""

    kind: StructuredOutputKind
    # json: the schema as compact JSON text (key order kept: it is the order fields are generated in);
    # regex / grammar: the pattern / EBNF text; choice: the allowed strings; json_object: "".
    value: str | tuple[str, ...] = ""
    # JSON kinds only: whether any whitespace may separate JSON tokens (vLLM's default). False forces
    # xgrammar's fixed separators, which stops a model from padding its JSON with endless newlines.
    any_whitespace: bool = True


def parse_structured_output(values: dict[str, Any]) -> tuple[StructuredOutputSpec | None, dict[str, Any]]:
    """Takes the constraint keys out of `values`; returns (spec or None, the other keys, untouched).

    Accepts `structured_outputs` and `guided_decoding` (a dict, or that dict as a JSON string) and the
    top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`. A null value counts as
    absent. A request sending more than one of them, or one naming more than one kind, is refused.
    """
    remaining = dict(values)
    found = {key: remaining.pop(key) for key in (*DICT_SPELLINGS, *LEGACY_SPELLINGS) if key in values}
    found = {key: value for key, value in found.items() if value is not None}
    if not found:
        return None, remaining
    if len(found) > 1:
        raise ValueError(f"structured output was given more than once ({', '.join(found)}); send one of "
                         f"them, e.g. structured_outputs={{\"json\": <schema>}}")
    key, raw = next(iter(found.items()))
    if key in LEGACY_SPELLINGS:
        kind = LEGACY_SPELLINGS[key]
        return StructuredOutputSpec(kind, _check_value(key, kind, raw)), remaining
    return spec_from_fields(key, _as_dict(key, raw)), remaining


def loads_client_json(text: str, what: str, example: str) -> Any:
    """json.loads of text a client sent: malformed JSON, or JSON nested past what Python's parser
    recurses into (100k brackets), is a ValueError naming `what`, never an internal error."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not valid JSON ({exc}); send e.g. {example}") from None
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply to parse; send e.g. {example}") from None


def json_depth(text: str) -> int:
    """How deeply a JSON text nests objects and arrays (0 for a scalar), by one pass over its
    characters: no recursion, whatever the depth."""
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth -= 1
    return deepest


def _as_dict(key: str, raw: Any) -> dict[str, Any]:
    example = f'{key}={{"json": <schema>}} or {{"regex": "..."}}'
    if isinstance(raw, str):
        raw = loads_client_json(raw, key, example)
    if not isinstance(raw, dict):
        raise ValueError(f"{key} must be an object, got {type(raw).__name__}; send e.g. {example}")
    return raw


def spec_from_fields(source: str, fields: dict[str, Any]) -> StructuredOutputSpec:
    """Builds the spec from {kind: value, options...} (vLLM's StructuredOutputsParams fields); `source`
    names the key in error messages."""
    known = (*CONSTRAINT_KEYS, *OPTION_KEYS)
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise ValueError(f"{source}: unsupported key(s) {', '.join(unknown)}; supported: {', '.join(known)}")
    for key in BACKEND_KEYS:
        backend = fields.get(key)
        if backend is not None and backend not in ACCEPTED_BACKENDS:
            raise ValueError(f"{source}.{key} {backend!r} is not available; this server runs xgrammar "
                             "(leave it out)")
    for key in (*IGNORED_FLAGS, *HONOURED_FLAGS):
        if fields.get(key) is not None and not isinstance(fields[key], bool):
            raise ValueError(f"{source}.{key} must be true or false, got {fields[key]!r}")
    for key, message in UNSUPPORTED_OPTIONS.items():
        if fields.get(key) is not None:
            raise ValueError(f"{source}: {message}")
    # A serialized vLLM StructuredOutputsParams carries every field, null or false where unused.
    given = [k for k in CONSTRAINT_KEYS if fields.get(k) is not None and fields.get(k) is not False]
    if len(given) != 1:
        what = f"got {' and '.join(given)}" if given else "got none"
        raise ValueError(f"{source} takes exactly one of {', '.join(CONSTRAINT_KEYS)}; {what}")
    kind = given[0]
    value = _check_value(f"{source}.{kind}", kind, fields[kind])
    # Whitespace means something to JSON only: one canonical spec per constraint, for the cache.
    any_whitespace = not fields.get("disable_any_whitespace") if kind in ("json", "json_object") else True
    return StructuredOutputSpec(kind, value, any_whitespace)


def _check_value(name: str, kind: str, value: Any) -> str | tuple[str, ...]:
    if kind == "json":
        if isinstance(value, str):
            value = loads_client_json(value, name, 'a JSON schema object, {"type": "object", ...}')
        if not isinstance(value, dict):
            raise ValueError(f"{name} must be a JSON schema object, got {type(value).__name__}")
        for path, node in _subschemas(value, "#"):
            unsafe = [k for k in UNSAFE_STRING_KEYWORDS if k in node]
            if unsafe:
                raise ValueError(
                    f"{name}: {' and '.join(unsafe)} at {path} is not supported: the grammar engine (xgrammar "
                    "0.2.8) would let such a string hold raw control characters, i.e. invalid JSON "
                    "(mlc-ai/xgrammar#800); remove it, or bound the string with a pattern instead, e.g. "
                    '"pattern": "^[A-Za-z0-9 ]{1,20}$"')
        try:
            return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
        except RecursionError:  # a schema object built in Python rather than parsed
            raise ValueError(f"{name} is nested too deeply") from None
    if kind == "json_object":
        if value is not True:
            raise ValueError(f"{name} must be true")
        return ""
    if kind == "choice":
        if not isinstance(value, list | tuple) or not value:
            raise ValueError(f"{name} must be a non-empty list of strings")
        if not all(isinstance(c, str) and c for c in value):
            raise ValueError(f"{name} must hold non-empty strings only")
        return tuple(value)
    if not isinstance(value, str) or not value:  # regex, grammar
        raise ValueError(f"{name} must be a non-empty string")
    return value


# Where JSON Schema nests schemas: keyword -> how (one schema, a list of them, or a map of name -> schema).
# Everything else (enum, const, default, examples, a property's name) is data and is not walked.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LIST = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_MAP = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def _subschemas(root: Any, root_path: str) -> Iterator[tuple[str, dict]]:
    """Every schema object in a JSON schema (the root included), with its JSON-pointer-like path.
    Iterative: a schema nested as deeply as JSON parsing allows never exhausts Python's stack."""
    stack = [(root_path, root)]
    while stack:
        path, node = stack.pop()
        if not isinstance(node, dict):
            continue
        yield path, node
        children = []
        for key in _ONE:
            if isinstance(node.get(key), dict):
                children.append((f"{path}/{key}", node[key]))
        for key in _LIST:
            if isinstance(node.get(key), list):
                children += [(f"{path}/{key}/{i}", child) for i, child in enumerate(node[key])]
        for key in _MAP:
            if isinstance(node.get(key), dict):
                children += [(f"{path}/{key}/{name}", child) for name, child in node[key].items()]
        stack += reversed(children)  # depth first, in document order
