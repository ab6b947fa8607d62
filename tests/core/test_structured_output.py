"""Structured output, piece by piece: parsing a request's constraint (sampling_params.py), compiling it
with xgrammar against this project's tokenizers (core/structured_output.py), and masking logits so that
sampling follows it (worker/bitmask.py). tests/engine/test_structured_engine.py runs it through the engine.

The sampling tests draw random logits from a seeded generator and sample with temperature over the
masked logits until the grammar has ended on EOS; the decoded text must then validate. The same logits
sampled without the mask must not, which shows the mask (not luck) made the text valid.
"""

from __future__ import annotations

import ast
import json
import re
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from orca_backend.core.structured_output import (
    StructuredOutputCompiler,
    StructuredOutputMatchers,
    grammar_for,
)
from orca_backend.model.checkpoint import EOS_TOKEN, train_byte_level_bpe
from orca_backend.sampling_params import StructuredOutputSpec, parse_structured_output
from orca_backend.scheduler_output import SchedulerOutput, decode_step, encode_step
from orca_backend.tokenizer import Tokenizer
from orca_backend.worker.bitmask import apply_bitmask, decode_bitmask

try:
    import xgrammar as xgr
except ImportError:  # until it is a dependency, only the parsing tests run (every other test uses `setup`)
    xgr = None

MAX_STEPS = 3000  # a random string field ends only when the closing quote is drawn: ~1/400 a step
PAD = 13  # the model's vocabulary is wider than the tokenizer's by this many (lm_head padding)

SCHEMA = {
    "type": "object",
    "properties": {
        # No maxLength: xgrammar 0.2.8 compiles a length-bounded string to a character class that admits
        # raw control characters (invalid JSON) and no escapes (mlc-ai/xgrammar#800).
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["yes", "no", "maybe so"]
# Arithmetic on one-digit numbers, ending with ";", e.g. "(3+4)*5;".
EBNF = 'root ::= expr ";"\nexpr ::= term ("+" term)*\nterm ::= factor ("*" factor)*\nfactor ::= [0-9] | "(" expr ")"'
EXPR = re.compile(r"[0-9()+*]+;")


def valid_person(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age", "color"}
            and isinstance(value["name"], str)
            and type(value["age"]) is int and value["color"] in ("red", "green", "blue"))


def valid_expression(text: str) -> bool:
    if not EXPR.fullmatch(text):
        return False
    try:
        ast.parse(text[:-1], mode="eval")  # balanced parentheses, an operand on each side of + and *
    except SyntaxError:
        return False
    return True


CASES = {
    "json": (StructuredOutputSpec("json", json.dumps(SCHEMA, separators=(",", ":"))), valid_person),
    "regex": (StructuredOutputSpec("regex", DATE), lambda text: re.fullmatch(DATE, text) is not None),
    "choice": (StructuredOutputSpec("choice", tuple(CHOICES)), lambda text: text in CHOICES),
    "grammar": (StructuredOutputSpec("grammar", EBNF), valid_expression),
}


# ------------------------------------------------------------------------------------- tokenizers
def write_byte_fallback_tokenizer(path: Path) -> Path:
    """A Llama-style (sentencepiece-like) tokenizer.json: "▁" for space, <0xNN> byte pieces for any
    character outside its small vocabulary, <unk>/<s>/</s> specials, and a decoder that strips the
    leading space. Merges are built left to right from a few words, so every merge is well formed."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, normalizers

    vocab: dict[str, int] = {}
    for token in ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
                  "▁", *string.ascii_letters, *string.digits, *string.punctuation]:
        vocab.setdefault(token, len(vocab))
    merges: list[tuple[str, str]] = []
    for word in ["▁the", "▁and", "▁name", "▁red", "▁blue", "▁green", "▁yes", "▁maybe", "ing", "20", "19",
                 '{"', '":', '",', "▁so", "name", "age", "color", "yes", "no"]:
        for i in range(1, len(word)):
            if word[: i + 1] not in vocab:
                merges.append((word[:i], word[i]))
                vocab[word[: i + 1]] = len(vocab)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(path))
    return path


@pytest.fixture(scope="module", params=["byte_level", "byte_fallback"])
def setup(request, tmp_path_factory):
    """(Tokenizer, StructuredOutputCompiler, EOS id) with a model vocabulary PAD ids wider than the tokenizer."""
    if xgr is None:
        pytest.skip("xgrammar is not installed")
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    if request.param == "byte_level":
        train_byte_level_bpe(384, seed=0).save(str(path))
        eos_token = EOS_TOKEN
    else:
        write_byte_fallback_tokenizer(path)
        eos_token = "</s>"
    tokenizer = Tokenizer(path)
    eos = tokenizer.token_to_id(eos_token)
    compiler = StructuredOutputCompiler(path, tokenizer.vocab_size + PAD, eos, max_threads=1)
    return tokenizer, compiler, eos


def allowed_ids(row: torch.Tensor, vocab_size: int) -> list[int]:
    logits = torch.zeros(1, vocab_size)
    apply_bitmask(logits, row.view(1, -1), [0])
    return (logits[0] == 0).nonzero().flatten().tolist()


def sample(logits: torch.Tensor, generator: torch.Generator, temperature: float = 1.0) -> int:
    return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator).item()


# --------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("case", list(CASES))
def test_constrained_sampling_follows_the_constraint(setup, case, seed):
    tokenizer, compiler, eos = setup
    spec, valid = CASES[case]
    vocab_size = compiler.vocab_size
    matchers = StructuredOutputMatchers(compiler)
    matchers.add("r", spec)
    logits_gen, sample_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 100)
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        logits = 3 * torch.randn(1, vocab_size, generator=logits_gen)
        bitmask = matchers.fill_bitmask(["r"])
        allowed = allowed_ids(bitmask[0], vocab_size)
        apply_bitmask(logits, bitmask, [0])
        token = sample(logits[0], sample_gen)
        assert token in allowed
        assert matchers.accept("r", token)
        if token == eos:
            break
        ids.append(token)
    else:
        pytest.fail(f"no EOS after {MAX_STEPS} tokens: {tokenizer.decode(ids)!r}")
    # These grammars have nothing to add once complete: EOS was the only token allowed, and still is.
    assert allowed == [eos]
    assert matchers.is_terminated("r")
    assert allowed_ids(matchers.fill_bitmask(["r"])[0], vocab_size) == [eos]
    text = tokenizer.decode(ids)
    assert valid(text), text

    # The same logits without the mask: the text must not validate (or the test proves nothing).
    logits_gen, sample_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 100)
    free: list[int] = []
    for _ in range(len(ids) + 1):
        token = sample(3 * torch.randn(vocab_size, generator=logits_gen)[: tokenizer.vocab_size], sample_gen)
        if token == eos:
            break
        free.append(token)
    assert not valid(tokenizer.decode(free)), tokenizer.decode(free)


def test_a_token_outside_the_grammar_is_refused_and_changes_nothing(setup):
    tokenizer, compiler, eos = setup
    matchers = StructuredOutputMatchers(compiler)
    matchers.add("r", CASES["regex"][0])
    letter = tokenizer.token_to_id("x")
    assert not matchers.accept("r", letter)
    assert not matchers.accept("r", eos)  # EOS before the grammar is complete
    for char in "2024-05-17":
        assert matchers.accept("r", tokenizer.token_to_id(char))
    assert not matchers.is_terminated("r")
    assert matchers.accept("r", eos) and matchers.is_terminated("r")
    assert not matchers.accept("r", tokenizer.token_to_id("1"))  # nothing after EOS
    matchers.remove("r")
    matchers.remove("r")  # idempotent: a request may end by abort after it ended otherwise
    assert "r" not in matchers and len(matchers) == 0


# ---------------------------------------------------------------------------------------- masking
def test_padding_and_special_ids_are_never_allowed(setup):
    tokenizer, compiler, eos = setup
    matchers = StructuredOutputMatchers(compiler)
    specials = [i for t in ("<unk>", "<s>") if (i := tokenizer.token_to_id(t)) is not None]
    # A grammar allowing any text: only the vocabulary's ordinary tokens may be sampled.
    matchers.add("any", StructuredOutputSpec("regex", r"(.|\n)*"))
    allowed = set(allowed_ids(matchers.fill_bitmask(["any"])[0], compiler.vocab_size))
    padding = set(range(tokenizer.vocab_size, compiler.vocab_size))
    assert eos in allowed and allowed.isdisjoint(padding) and allowed.isdisjoint(specials)
    assert {tokenizer.token_to_id(c) for c in string.ascii_letters + string.digits + "{}"} <= allowed


def test_a_mixed_batch_leaves_unconstrained_rows_untouched(setup):
    tokenizer, compiler, eos = setup
    matchers = StructuredOutputMatchers(compiler)
    matchers.add("json", CASES["json"][0])
    matchers.add("choice", CASES["choice"][0])
    bitmask = matchers.fill_bitmask(["json", "choice"])
    logits = torch.randn(5, compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    apply_bitmask(logits, bitmask, [3, 1])  # bitmask row 0 -> logits row 3, row 1 -> logits row 1
    for row in (0, 2, 4):
        assert torch.equal(logits[row], before[row])
    for bitmask_row, row in ((0, 3), (1, 1)):
        allowed = allowed_ids(bitmask[bitmask_row], compiler.vocab_size)
        kept = (logits[row] == before[row]).nonzero().flatten().tolist()
        assert kept == allowed and torch.isinf(logits[row]).sum() == compiler.vocab_size - len(allowed)
    decoded = compiler.tokenizer_info.decoded_vocab
    assert all(decoded[i].startswith(b"{") for i in allowed_ids(bitmask[0], compiler.vocab_size))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_apply_bitmask_on_cpu_dtypes(setup, dtype):
    tokenizer, compiler, _ = setup
    matchers = StructuredOutputMatchers(compiler)
    matchers.add("r", CASES["regex"][0])
    bitmask = matchers.fill_bitmask(["r"])
    digits = allowed_ids(bitmask[0], compiler.vocab_size)
    assert {tokenizer.token_to_id(d) for d in string.digits} <= set(digits)
    logits = torch.zeros(2, compiler.vocab_size, dtype=dtype)
    apply_bitmask(logits, bitmask, [1])
    assert torch.all(logits[0] == 0)
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == digits


def test_the_workers_mask_equals_xgrammars_kernel_through_the_wire(setup):
    """worker/bitmask.py is plain torch: it must mask exactly as xgrammar's own kernel does, from the rows
    as SchedulerOutput carries them, in process and encoded for a worker."""
    tokenizer, compiler, eos = setup
    matchers = StructuredOutputMatchers(compiler)
    for name in CASES:
        matchers.add(name, CASES[name][0])
    matchers.accept("regex", tokenizer.token_to_id("2"))
    bitmask = matchers.fill_bitmask(list(CASES))
    before = torch.randn(6, compiler.vocab_size, generator=torch.Generator().manual_seed(1))
    rows = [5, 0, 2, 3]
    expected = before.clone()
    full = torch.full((6, bitmask.shape[1]), -1, dtype=torch.int32)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(expected, full, vocab_size=compiler.vocab_size, indices=rows)
    raw = bitmask.numpy().tobytes()
    step = SchedulerOutput(0, [], [], [], bitmask_rows=rows, bitmask=raw)
    for wire in (raw, decode_step(encode_step(step)).bitmask):
        logits = before.clone()
        apply_bitmask(logits, decode_bitmask(wire, len(rows)), rows)
        assert torch.equal(logits, expected)
    with pytest.raises(ValueError, match="does not split into 3 rows"):
        decode_bitmask(raw, 3)


# --------------------------------------------------------------------------------------- compiling
def test_tokenizer_info_reads_the_vocab_type(setup):
    tokenizer, compiler, eos = setup
    info = compiler.tokenizer_info
    byte_fallback = tokenizer.token_to_id("<0x41>") is not None
    assert info.vocab_type == (xgr.VocabType.BYTE_FALLBACK if byte_fallback else xgr.VocabType.BYTE_LEVEL)
    assert info.add_prefix_space == byte_fallback  # the Llama-style normalizer prepends "▁"
    assert info.vocab_size == compiler.vocab_size and info.stop_token_ids == [eos]
    space = tokenizer.token_to_id("▁" if byte_fallback else "Ġ")
    assert info.decoded_vocab[space] == b" "


@pytest.mark.parametrize(("spec", "message"), [
    (StructuredOutputSpec("json", '{"type": "nope"}'), 'Unsupported type "nope"'),
    (StructuredOutputSpec("json", '{"properties": {"a": {"$ref": "#/$defs/missing"}}}'), "missing"),
    (StructuredOutputSpec("regex", "(ab"), "parenthesis is not closed"),
    (StructuredOutputSpec("grammar", 'root ::= item\n'), 'Rule "item" is not defined'),
    (StructuredOutputSpec("grammar", 'root ::= "a'), "string literal"),
])
def test_malformed_constraints_are_the_requests_value_error(setup, spec, message):
    _, compiler, _ = setup
    # Found by the cheap tokenizer-free check, and again by the compile that adding a request runs.
    for check in (grammar_for, lambda spec: StructuredOutputMatchers(compiler).add("r", spec)):
        with pytest.raises(ValueError, match=re.escape(message)) as info:
            check(spec)
        assert str(info.value).startswith(f"invalid {spec.kind} for structured output: ")
        assert ".cc:" not in str(info.value)  # xgrammar's source location is no use to a client


def test_choices_are_escaped_and_json_object_means_an_object(setup):
    _, compiler, _ = setup
    choices = ('say "hi"', "back\\slash", "two\nlines", "naïve 😀", "tab\there")
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiler.compile(StructuredOutputSpec("choice", choices)))
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    json_object = compiler.compile(StructuredOutputSpec("json_object"))
    matcher = xgr.GrammarMatcher(json_object)
    assert matcher.accept_string('{"a": [1, {"b": null}]}') and matcher.is_completed()
    assert not xgr.GrammarMatcher(json_object).accept_string("[")


def test_compiled_grammars_are_cached_by_spec(setup):
    tokenizer, _, eos = setup
    compiler = StructuredOutputCompiler(tokenizer.path, tokenizer.vocab_size, eos, cache_size=1)
    regex, choice = CASES["regex"][0], CASES["choice"][0]
    first = compiler.compile(regex)
    assert compiler.compile(StructuredOutputSpec("regex", DATE)) is first
    compiler.compile(choice)  # evicts the regex (cache_size=1)
    assert compiler.compile(regex) is not first


def test_a_compiled_grammar_crosses_processes_as_json(setup):
    """CompiledGrammar does not pickle; its JSON form plus the receiver's TokenizerInfo rebuilds it."""
    tokenizer, compiler, eos = setup
    spec = CASES["json"][0]
    text = compiler.compile(spec).serialize_json()
    matchers = StructuredOutputMatchers(compiler)
    matchers.add("sent", xgr.CompiledGrammar.deserialize_json(text, compiler.tokenizer_info))
    matchers.add("here", spec)
    for token in [tokenizer.token_to_id(c) for c in '{"name":'] + [eos]:
        bitmask = matchers.fill_bitmask(["sent", "here"])
        assert torch.equal(bitmask[0], bitmask[1])
        assert matchers.accept("sent", token) == matchers.accept("here", token)


# ----------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(("kind", "value"), [
    ("json", SCHEMA), ("regex", DATE), ("choice", CHOICES), ("grammar", EBNF),
])
def test_the_spellings_parse_to_the_same_spec(kind, value):
    legacy = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice", "grammar": "guided_grammar"}
    spellings = [
        {"structured_outputs": {kind: value}},
        {"structured_outputs": json.dumps({kind: value})},  # Triton's vLLM backend sends a JSON string
        {"guided_decoding": json.dumps({kind: value, "backend": "xgrammar"})},  # Triton vLLM backend <= 25.10
        {legacy[kind]: value},
    ]
    if kind == "json":
        spellings.append({"guided_json": json.dumps(SCHEMA, indent=2)})  # the schema as a string
        spellings.append({"structured_outputs": {"json": json.dumps(SCHEMA), "regex": None, "json_object": False}})
    specs = set()
    for values in spellings:
        spec, remaining = parse_structured_output({"temperature": 0.5, **values})
        assert remaining == {"temperature": 0.5}
        specs.add(spec)
    assert len(specs) == 1
    spec = specs.pop()
    assert spec.kind == kind
    expected = {"json": json.dumps(SCHEMA, separators=(",", ":")), "choice": tuple(CHOICES)}.get(kind, value)
    assert spec.value == expected


def test_a_serialized_vllm_structured_outputs_params_is_accepted():
    """Triton's OpenAI frontend sends json.dumps(asdict(vllm StructuredOutputsParams(json=...))): every field
    of the dataclass, null or false where unset (the current one, and the older GuidedDecodingParams')."""
    current = {"json": SCHEMA, "regex": None, "choice": None, "grammar": None, "json_object": None,
               "disable_any_whitespace": False, "disable_additional_properties": False, "whitespace_pattern": None,
               "structural_tag": None, "_backend": None, "_backend_was_auto": False}
    older = {"json": None, "regex": DATE, "choice": None, "grammar": None, "json_object": None, "backend": "xgrammar",
             "backend_was_auto": False, "disable_fallback": False, "disable_any_whitespace": False,
             "disable_additional_properties": True, "whitespace_pattern": None, "structural_tag": None}
    spec, _ = parse_structured_output({"structured_outputs": json.dumps(current)})
    assert spec == StructuredOutputSpec("json", json.dumps(SCHEMA, separators=(",", ":")))
    spec, _ = parse_structured_output({"guided_decoding": json.dumps(older)})
    assert spec == StructuredOutputSpec("regex", DATE)
    spec, _ = parse_structured_output({"structured_outputs": {**current, "disable_any_whitespace": True}})
    assert not spec.any_whitespace


def test_parse_without_a_constraint_and_options():
    values = {"max_tokens": 4, "guided_json": None}
    assert parse_structured_output(values) == (None, {"max_tokens": 4})
    assert values == {"max_tokens": 4, "guided_json": None}  # the caller's dict is left alone
    spec, _ = parse_structured_output({"structured_outputs": {"json_object": True, "disable_any_whitespace": True}})
    assert spec == StructuredOutputSpec("json_object", "", any_whitespace=False)
    spec, _ = parse_structured_output({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}})
    assert spec == StructuredOutputSpec("regex", "a+")  # whitespace only matters to JSON


@pytest.mark.parametrize(("values", "message"), [
    ({"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA}, "more than once"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "more than once"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "exactly one of json, regex, choice, grammar, "
                                                            "json_object; got regex and choice"),
    ({"structured_outputs": {}}, "got none"),
    ({"structured_outputs": {"regexp": "a"}}, "unsupported key(s) regexp"),
    ({"structured_outputs": "{not json"}, "structured_outputs is not valid JSON"),
    ({"guided_decoding": "[1]"}, "guided_decoding must be an object"),
    ({"guided_decoding": {"regex": "a", "backend": "outlines"}}, "backend 'outlines' is not available"),
    ({"guided_json": "{bad"}, "guided_json is not valid JSON"),
    ({"guided_json": [1]}, "guided_json must be a JSON schema object"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice must be a non-empty list"),
    ({"guided_choice": ["a", 1]}, "guided_choice must hold non-empty strings"),
    ({"guided_regex": ""}, "guided_regex must be a non-empty string"),
    ({"structured_outputs": {"json_object": "yes"}}, "json_object must be true"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " *"}}, "whitespace_pattern is not supported"),
    ({"structured_outputs": {"structural_tag": "{}"}}, "structural_tag is not supported"),
    ({"structured_outputs": {"regex": "a", "_backend": "guidance"}}, "_backend 'guidance' is not available"),
    ({"structured_outputs": {"regex": "a", "disable_fallback": "no"}}, "disable_fallback must be true or false"),
    # xgrammar 0.2.8 would let a length-bounded string hold raw control characters (mlc-ai/xgrammar#800).
    ({"guided_json": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}}}},
     "maxLength at #/properties/name is not supported"),
    ({"guided_json": {"$defs": {"a": {"items": [{"minLength": 1}]}}}}, "minLength at #/$defs/a/items/0"),
])
def test_bad_requests_are_refused_with_a_clear_message(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_structured_output(values)


def test_length_keywords_are_refused_only_where_they_are_schema_keywords():
    """A property *named* maxLength, or the word in an enum or a default, is data: the schema is fine."""
    schema = {"type": "object", "properties": {"maxLength": {"type": "integer"}},
              "default": {"minLength": 1}, "enum": [{"maxLength": 2}]}
    spec, _ = parse_structured_output({"guided_json": schema})
    assert spec.kind == "json"


def test_parsing_does_not_import_torch_or_xgrammar():
    """The frontend (Triton's stub process) parses requests and must stay free of torch."""
    code = ("import sys; from orca_backend.sampling_params import parse_structured_output; "
            "parse_structured_output({'guided_regex': 'a+'}); "
            "assert not {'torch', 'xgrammar', 'transformers'} & set(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
