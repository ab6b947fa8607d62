"""Per-request sampling and stopping parameters (`SamplingParams`), validated at construction, and the
structured-output constraint a request may carry (`StructuredOutputSpec`: a JSON schema, a regex, a
choice, a grammar) with the parser that takes it out of a client's `sampling_parameters`, whichever
spelling it came in (vLLM's StructuredOutputsParams lives in its sampling_params.py too).

Plain Python on purpose: `SamplingParams` is imported by every layer, the torch-free Triton stub
included, and parsing errors are ValueErrors the frontend answers with INVALID_ARG before the request
reaches the engine. Compiling a spec needs xgrammar and the model's tokenizer, and happens in the
engine core (core/structured_output.py); a spec the parser accepts may still fail to compile there (a
malformed regex, an undefined grammar rule): that request then ends with finish reason "invalid".
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
MAX_TOP_K = 2**31 - 1  # anything at or above the vocabulary means no cut
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
MAX_N = 128  # samples per request: each is a running request of its own
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-2, 2] (vLLM, OpenAI)
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100] (OpenAI)
# A temperature below this samples greedily, as in vLLM (_SAMPLING_EPS): dividing the logits by 1e-300
# gives infinities (it is 0 in float32) and the draw would come from NaNs.
SAMPLING_EPS = 1e-5
# Per-request token lists reach every iteration (the min_tokens ban, the logit bias), and under tp/pp
# every rank: their size is bounded here, so one request cannot slow every other one's iterations.
MAX_STOP_TOKEN_IDS = 1024  # distinct stop_token_ids
MAX_LOGIT_BIAS_TOKENS = 1024  # logit_bias entries


@dataclass
class SamplingParams:
    """vLLM's names and semantics. Logits are processed in vLLM v1's order: the structured-output mask,
    logit_bias (and the min_tokens ban), then the repetition, frequency and presence penalties, then
    temperature, top-k and top-p; greedy takes the argmax of the processed logits."""

    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop conditions are ignored until this many tokens exist
    temperature: float = 1.0  # 0 (or anything below SAMPLING_EPS) means greedy
    top_p: float = 1.0  # 0 means greedy too (OpenAI allows it; vLLM refuses it)
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None  # same seed, same tokens, whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # stop strings; excluded from the returned text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Samples of the prompt, each with its own generator (seed + its index, as vLLM derives them),
    # penalties and stop rules; the prompt is prefilled once (engine/llm_engine.py).
    n: int = 1
    # Penalties, row-wise before temperature (vLLM v1): a token's logit loses presence_penalty once if
    # the token occurs in the output so far, and frequency_penalty times its count there; the logit of
    # any token of the prompt or the output is divided by repetition_penalty when positive, multiplied
    # by it otherwise.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    # Return the sampled token's log-probability and rank with this many top alternatives (0: only
    # the sampled token), from the model's raw logits (vLLM's default "raw_logprobs": before any
    # processing above, but after the structured-output mask); None: no logprobs.
    logprobs: int | None = None
    # The log-probability of every prompt token given those before it, with this many top
    # alternatives (0: only the prompt token itself), from the raw logits of the prompt's prefill;
    # the first prompt token has none (nothing precedes it). None: no prompt logprobs. A request
    # asking for them never reads the prefix cache (a cached prefix has no logits), as in vLLM.
    prompt_logprobs: int | None = None
    # Structured output (a JSON schema, a regex, a choice, an EBNF grammar; parsed below): every
    # token is sampled from what the constraint allows, and the request ends ("stop") once the grammar is
    # complete and EOS was sampled. A dict in vLLM's StructuredOutputsParams shape is parsed.
    structured_outputs: StructuredOutputSpec | None = None
    # The LoRA adapter to run with (EngineConfig.enable_lora; one of the deployment's adapters), or None
    # for the base model. Triton's vLLM backend and its OpenAI frontend send it in sampling_parameters;
    # vLLM's own API takes it as LLM.generate's lora_request.
    lora_name: str | None = None

    def __post_init__(self) -> None:
        _check(isinstance(self.n, int) and not isinstance(self.n, bool) and 1 <= self.n <= MAX_N,
               f"n must be an integer in [1, {MAX_N}] (samples of the prompt), got {self.n!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(isinstance(self.max_tokens, int) and self.max_tokens > 0, f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        # Every value below reaches the sampler in a batch with other requests: one the sampler cannot
        # take (an infinite temperature, a seed torch refuses, a top_k beyond int64) must be refused here.
        _check(isinstance(self.temperature, int | float) and math.isfinite(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(isinstance(self.top_p, int | float) and 0 <= self.top_p <= 1,
               f"top_p must be in [0, 1] (0 is greedy), got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and -1 <= self.top_k <= MAX_TOP_K,
               f"top_k must be -1, 0 or a positive integer up to {MAX_TOP_K}, got {self.top_k!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED),
               f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers")
        self.stop_token_ids = list(dict.fromkeys(self.stop_token_ids))  # duplicates change nothing but the cost
        _check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS,
               f"{len(self.stop_token_ids)} distinct stop_token_ids, more than the limit of {MAX_STOP_TOKEN_IDS}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_number(value) and -MAX_PENALTY <= value <= MAX_PENALTY,
                   f"{name} must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}")
        rep = self.repetition_penalty
        _check(_is_number(rep) and math.isfinite(rep) and rep > 0,
               f"repetition_penalty must be a finite number > 0 (1 is none), got {rep!r}")
        if self.logit_bias is not None:
            _check(isinstance(self.logit_bias, dict),
                   f"logit_bias must map token ids to numbers, got {self.logit_bias!r}")
            _check(len(self.logit_bias) <= MAX_LOGIT_BIAS_TOKENS,
                   f"logit_bias has {len(self.logit_bias)} entries, more than the limit of {MAX_LOGIT_BIAS_TOKENS}")
            for token, bias in self.logit_bias.items():
                _check(isinstance(token, int) and not isinstance(token, bool) and token >= 0,
                       f"logit_bias keys must be token ids (integers >= 0), got {token!r}")
                _check(_is_number(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS,
                       f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                       f"got {bias!r} for token {token}")  # fmt: skip
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and not isinstance(self.logprobs, bool)
                                         and 0 <= self.logprobs <= MAX_LOGPROBS),
               f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (top alternatives returned per token), "
               f"got {self.logprobs!r}")  # fmt: skip
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and not isinstance(self.prompt_logprobs, bool)
                                                and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
               f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] (top alternatives returned per prompt "
               f"token), got {self.prompt_logprobs!r}")  # fmt: skip
        _check(self.lora_name is None or (isinstance(self.lora_name, str) and self.lora_name != ""),
               f"lora_name must be an adapter's name (a non-empty string) or null, got {self.lora_name!r}")
        if isinstance(self.structured_outputs, dict | str):
            self.structured_outputs, _ = parse_structured_output({"structured_outputs": self.structured_outputs})
        _check(self.structured_outputs is None or isinstance(self.structured_outputs, StructuredOutputSpec),
               f"structured_outputs must be a StructuredOutputSpec or a dict like {{\"json\": <schema>}}, "
               f"got {type(self.structured_outputs).__name__}")  # fmt: skip
        # The grammar decides when the output may end, and may end it before min_tokens: EOS cannot be both
        # banned (min_tokens) and the only token the grammar allows.
        _check(self.structured_outputs is None or self.min_tokens == 0,
               f"min_tokens={self.min_tokens} cannot be combined with structured output (the constraint may "
               "complete before that many tokens); leave min_tokens at 0")

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_p == 0.0

    @property
    def penalized(self) -> bool:
        """Any penalty: the sampler must know the request's output tokens (and prompt, for repetition)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Builds params from a client's dict (e.g. Triton's `sampling_parameters` JSON).

        Numbers may arrive as strings (genai-perf sends ``{"max_tokens": "32"}``); unknown keys are
        an error rather than silently ignored, so a typo never changes what a user gets. Structured
        output comes in any of its spellings (`structured_outputs`, `guided_decoding`, `guided_json`,
        `guided_regex`, `guided_choice`, `guided_grammar`; `parse_structured_output`).
        """
        spec, values = parse_structured_output(values)
        if "best_of" in values:  # vLLM V1 refuses it too; 1 and null ask for nothing
            values = dict(values)
            best_of = values.pop("best_of")
            _check(best_of is None or _coerce("n", best_of) == 1,
                   f"best_of is not supported (vLLM V1 removed it), got {best_of!r}: ask for n samples, with "
                   "logprobs, and rank them by cumulative_logprob")  # fmt: skip
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        _check(not unknown, f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(known)}")
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            kwargs[key] = _coerce(key, raw)
        return cls(**kwargs, structured_outputs=spec)

    @classmethod
    def from_json(cls, text: str) -> SamplingParams:
        return cls.from_dict(parse_sampling_json(text))


def parse_sampling_json(text: str) -> dict[str, Any]:
    """A `sampling_parameters` JSON object as a dict (empty text: no parameters)."""
    if not text.strip():
        return {}
    values = loads_client_json(text, "sampling_parameters", '{"temperature": 0, "max_tokens": 16}')
    _check(isinstance(values, dict), f"sampling_parameters must be a JSON object, got {type(values).__name__}")
    return values


_INT_KEYS = {"n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"}
_FLOAT_KEYS = {"temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty"}


def _coerce(key: str, raw: Any) -> Any:
    if raw is None and key in ("seed", "logprobs", "prompt_logprobs", "logit_bias"):
        return None
    if key in _INT_KEYS:
        if isinstance(raw, bool):
            raise ValueError(f"{key} must be an integer, got {raw!r}")
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        if isinstance(raw, str):
            try:
                return int(raw.strip())
            except ValueError:
                raise ValueError(f"{key} must be an integer, got {raw!r}") from None
        _check(isinstance(raw, int), f"{key} must be an integer, got {raw!r}")
        return raw
    if key in _FLOAT_KEYS:
        if isinstance(raw, bool):
            raise ValueError(f"{key} must be a number, got {raw!r}")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a number, got {raw!r}") from None
    if key == "ignore_eos":
        if isinstance(raw, str) and raw.lower() in ("true", "false"):
            return raw.lower() == "true"
        _check(isinstance(raw, bool), f"ignore_eos must be a boolean, got {raw!r}")
        return raw
    if key == "stop":
        _check(isinstance(raw, (str, list)), f"stop must be a string or a list of strings, got {raw!r}")
        return raw
    if key == "stop_token_ids":
        _check(isinstance(raw, list), f"stop_token_ids must be a list of integers, got {raw!r}")
        # Bounded before anything is converted: a 4 MiB request could otherwise carry ~2 M ids.
        _check(len(raw) <= MAX_STOP_TOKEN_IDS, f"stop_token_ids has {len(raw)} entries, more than the limit of "
                                               f"{MAX_STOP_TOKEN_IDS}")  # fmt: skip
        return [_coerce("seed", t) for t in raw]
    if key == "logit_bias":
        # A JSON object's keys are strings: {"50256": -100}.
        _check(isinstance(raw, dict), f"logit_bias must be an object mapping token ids to numbers, got {raw!r}")
        _check(len(raw) <= MAX_LOGIT_BIAS_TOKENS, f"logit_bias has {len(raw)} entries, more than the limit of "
                                                  f"{MAX_LOGIT_BIAS_TOKENS}")  # fmt: skip
        return {_coerce_bias_key(token): _coerce_bias_value(bias) for token, bias in raw.items()}
    return raw


def _coerce_bias_key(raw: Any) -> int:
    if isinstance(raw, str):
        try:
            return int(raw.strip())
        except ValueError:
            raise ValueError(f"logit_bias keys must be token ids, got {raw!r}") from None
    _check(isinstance(raw, int) and not isinstance(raw, bool), f"logit_bias keys must be token ids, got {raw!r}")
    return raw


def _coerce_bias_value(raw: Any) -> float:
    try:
        _check(not isinstance(raw, bool), "")
        return float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias values must be numbers, got {raw!r}") from None


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


# ------------------------------------------------------------------ structured output
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


# ---------------------------------------------------------------------------------- embeddings
POOLING_MODES = ("last", "mean", "cls")  # the last token's, the mean over the prompt's, the first token's


@dataclass(frozen=True)
class PoolingConfig:
    """How a checkpoint's embeddings are pooled: sentence-transformers' `1_Pooling/config.json`
    (last token, mean or CLS) and whether `modules.json` ends in a Normalize module; without them,
    vLLM's default for a decoder run as an embedding model: the last token, L2-normalised. `dimensions`
    (Matryoshka truncation) is allowed where config.json says the model was trained for it
    (`is_matryoshka`, or the list `matryoshka_dimensions` it was trained at)."""

    mode: str = "last"
    normalize: bool = True
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] = ()


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request's parameters (vLLM's PoolingParams for task "embed"): `dimensions` keeps
    the first that many values before the normalisation (Matryoshka models only); None keeps all."""

    dimensions: int | None = None

    def __post_init__(self) -> None:
        _check(self.dimensions is None or (isinstance(self.dimensions, int) and not isinstance(self.dimensions, bool)
                                           and self.dimensions >= 1),
               f"dimensions must be a positive integer, got {self.dimensions!r}")  # fmt: skip


def read_pooling_config(model_dir: str | Path, hf_config: dict[str, Any]) -> PoolingConfig:
    """The checkpoint's pooling (PoolingConfig). A sentence-transformers pooling this engine does not
    compute (max, mean of square-root length, weighted mean, several at once) is kept by its names in
    `mode`: the engine refuses embedding requests with them, and serves generation as any model's."""
    model_dir = Path(model_dir)
    modules_path = model_dir / "modules.json"
    mode, normalize = "last", True
    if modules_path.is_file():
        modules = json.loads(modules_path.read_text())
        types = [str(m.get("type", "")) for m in modules]
        normalize = any(t.endswith(".Normalize") for t in types)
        pooling = next((m for m in modules if str(m.get("type", "")).endswith(".Pooling")), None)
        if pooling is not None:
            settings = json.loads((model_dir / pooling.get("path", "") / "config.json").read_text())
            chosen = [key for key, value in settings.items() if key.startswith("pooling_mode_") and value is True]
            names = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
            mode = names[chosen[0]] if len(chosen) == 1 and chosen[0] in names else "+".join(chosen) or "none"
    dims = hf_config.get("matryoshka_dimensions") or ()
    return PoolingConfig(mode, normalize, bool(hf_config.get("is_matryoshka")) or bool(dims), tuple(dims))
