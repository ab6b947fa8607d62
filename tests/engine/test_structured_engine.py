"""Structured output through the engine (docs/architecture.md, "Structured output") on a tiny random-weight
checkpoint with a byte-level BPE tokenizer: the parsed constraint compiles in the engine core, its
bitmask rows travel with the batch, the sampling worker masks the rows' logits, and the core advances
each matcher with the token that landed. (Where a request whose grammar compiled takes its place in
the scheduler's queue is tests/core/test_scheduler.py's.)

A random model left alone writes byte soup, so a constrained output that parses is the mask's doing; each
validity test also checks that the same requests unconstrained do not parse. The JSON case uses compact
separators (disable_any_whitespace): with any whitespace allowed, this model pads its JSON with
whitespace until max_tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest

from orca_backend import LLM, EngineConfig, SamplingParams
from orca_backend.engine.llm_engine import LLMEngine, RequestOutput
from orca_backend.sampling_params import StructuredOutputSpec
from orca_backend.server.protocol import parse_inputs

pytest.importorskip("xgrammar")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "color"],
}
DATE = r"\d{4}-\d{2}-\d{2}"
CHOICES = ["yes", "no", "maybe so"]
EBNF = 'root ::= expr ";"\nexpr ::= num (("+" | "*") num){0,3}\nnum ::= [1-9] [0-9]?'
EXPR = re.compile(r"[1-9][0-9]?([+*][1-9][0-9]?){0,3};")


def valid_person(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == {"name", "age", "color"}
            and isinstance(value["name"], str) and re.fullmatch("[a-z]{1,8}", value["name"]) is not None
            and type(value["age"]) is int and 0 <= value["age"] <= 120 and value["color"] in ("red", "green", "blue"))


CASES = {
    "json": ({"json": SCHEMA, "disable_any_whitespace": True}, valid_person),
    "regex": ({"regex": DATE}, lambda text: re.fullmatch(DATE, text) is not None),
    "choice": ({"choice": CHOICES}, lambda text: text in CHOICES),
    "grammar": ({"grammar": EBNF}, lambda text: EXPR.fullmatch(text) is not None),
}
PROMPTS = ["the cat sat on", "hello there", "kalo mine to"]
# Greedy, and seeded sampling with two seeds.
SAMPLING = [{"temperature": 0.0}, {"temperature": 1.0, "seed": 1}, {"temperature": 0.8, "seed": 2, "top_p": 0.9}]


def constrained(case: str, max_tokens: int = 64, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured_outputs=CASES[case][0], **kwargs)


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint[0])


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint, max_num_seqs=8)


def run(engine: LLMEngine, prompts: list, params: list[SamplingParams], ids: list[str] | None = None
        ) -> dict[str, list[RequestOutput]]:  # fmt: skip
    """Drives an in-process engine until every request has finished; every event, by request id."""
    events: dict[str, list[RequestOutput]] = {}
    streams = engine.add_requests(prompts, params, ids, on_output=lambda e: events.setdefault(e.request_id, []).append(e))
    while any(not (events.get(s.request_id) and events[s.request_id][-1].finished) for s in streams):
        engine.step()
    while engine.has_work():
        engine.step()
    return events


def text_of(events: list[RequestOutput]) -> str:
    return "".join(e.new_text for e in events)


def ids_of(events: list[RequestOutput]) -> list[int]:
    return [t for e in events for t in e.new_token_ids]


def assert_clean(engine: LLMEngine) -> None:
    """Nothing of a finished request is left: no matcher, no compile, no K/V."""
    core = engine.core
    assert core.structured.num_matchers == 0 and core.structured.num_pending == 0
    assert core.scheduler.num_compiling == 0 and not core.scheduler.has_work()
    assert core.kv.used_blocks == 0


# ------------------------------------------------------------------------------------------ validity
@pytest.mark.parametrize("case", list(CASES))
def test_constrained_outputs_always_follow_the_constraint(llm, case):
    valid = CASES[case][1]
    params = [constrained(case, **s) for s in SAMPLING for _ in PROMPTS]
    outs = llm.generate(PROMPTS * len(SAMPLING), params)
    for out in outs:
        assert valid(out.text), out.text
        assert out.finish_reason == "stop"  # the grammar completed and EOS was sampled
        assert out.output_ids[-1] == llm.engine.model_config.eos_token_id
    # The same requests without the constraint: the random model's text does not parse.
    free = llm.generate(PROMPTS * len(SAMPLING), [replace(p, structured_outputs=None) for p in params])
    assert not any(valid(out.text) for out in free), [out.text for out in free]
    assert_clean(llm.engine)


def test_a_mixed_batch_gives_every_request_what_it_gets_alone(llm):
    """Bitmask rows land on their own rows only: unconstrained requests beside constrained ones get the
    tokens they get alone, and so do the constrained ones. Logprobs come from the masked logits (as in
    vLLM v1), so every alternative a constrained request reports is one its grammar allowed."""
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
        constrained("json", temperature=0.0),
        SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True, presence_penalty=0.5),
        constrained("regex", temperature=1.0, seed=4, logprobs=5),
        constrained("choice", temperature=0.7, seed=5),
        SamplingParams(max_tokens=12, temperature=0.9, seed=6, logprobs=2, ignore_eos=True),
        constrained("grammar", temperature=0.0, repetition_penalty=1.3),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    together = llm.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, together, strict=True):
        (alone,) = llm.generate([prompt], p)
        assert out.output_ids == alone.output_ids
    regex = together[3]
    assert re.fullmatch(DATE, regex.text)
    eos = llm.engine.model_config.eos_token_id
    for step in regex.logprobs:
        allowed = [t for t, logprob in step.items() if logprob.logprob > float("-inf")]
        assert allowed and all(t == eos or re.fullmatch(r"[0-9-]+", step[t].decoded_token) for t in allowed), step
    assert list(regex.logprobs[-1])[0] == eos and regex.logprobs[-1][eos].logprob == 0.0  # EOS alone was allowed
    assert_clean(llm.engine)


def test_a_malformed_constraint_fails_that_request_alone(checkpoint):
    engine = LLMEngine(EngineConfig(model=checkpoint, max_num_seqs=8))
    good = [SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True), constrained("regex", temperature=0.0)]
    bad = {  # name: (constraint, what the message says)
        "schema": ({"json": {"type": "nope"}}, ("invalid json for structured output: ", 'Unsupported type "nope"')),
        "regex": ({"regex": "(ab"}, ("invalid regex for structured output: ", "parenthesis is not closed")),
        "grammar": ({"grammar": "root ::= item"}, ("invalid grammar for structured output: ", 'line 1, column 10: '
                                                                                          'Rule "item" is not defined')),
    }
    params = [good[0], *(SamplingParams(max_tokens=10, structured_outputs=so) for so, _ in bad.values()), good[1]]
    ids = ["good-free", *bad, "good-regex"]
    events = run(engine, ["hello there"] * len(params), params, ids)
    for name, (_, (prefix, detail)) in bad.items():
        (last,) = events[name]  # one event: it never ran
        assert last.finish_reason == "invalid" and last.error.startswith(prefix) and detail in last.error, last.error
        assert ".cc:" not in last.error  # xgrammar's source location is no use to a client
        assert last.new_token_ids == []
    alone = [ids_of(next(iter(run(engine, ["hello there"], [p]).values()))) for p in good]
    assert [ids_of(events["good-free"]), ids_of(events["good-regex"])] == alone
    assert events["good-regex"][-1].finish_reason == "stop"
    assert_clean(engine)
    # The offline LLM checks the constraint itself before anything runs.
    with pytest.raises(ValueError, match=re.escape("invalid regex for structured output")):
        LLM(checkpoint).generate(["hello"], [SamplingParams(structured_outputs={"regex": "(ab"})])


def test_the_grammar_ends_the_request_and_user_stops_still_work(llm):
    """A complete grammar ends the request ("stop") with ignore_eos too: once EOS is accepted nothing else
    is allowed. Stop strings and stop token ids still end it early, where the user asked."""
    tokenizer = llm.tokenizer
    dash = tokenizer.token_to_id("-")
    (full, ignoring, cut, stopped) = llm.generate(["hello there"] * 4, [
        constrained("regex", temperature=0.0), constrained("regex", temperature=0.0, ignore_eos=True),
        constrained("regex", temperature=0.0, stop=["-"]), constrained("regex", temperature=0.0, stop_token_ids=[dash]),
    ])  # fmt: skip
    assert re.fullmatch(DATE, full.text) and full.finish_reason == "stop"
    assert ignoring.output_ids == full.output_ids and ignoring.finish_reason == "stop"
    assert cut.text == full.text[:4] and cut.finish_reason == "stop"
    assert stopped.output_ids == full.output_ids[: len(stopped.output_ids)] and stopped.output_ids[-1] == dash
    assert stopped.finish_reason == "stop"
    assert_clean(llm.engine)


# ---------------------------------------------------------------------------------- request side
def test_every_spelling_reaches_the_engine_as_the_same_constraint():
    schema_text = json.dumps(SCHEMA)
    vllm_asdict = {"json": SCHEMA, "regex": None, "choice": None, "grammar": None, "json_object": None,
                   "disable_any_whitespace": True, "disable_additional_properties": False,
                   "whitespace_pattern": None, "structural_tag": None, "_backend": None, "_backend_was_auto": False}
    spellings = [
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
        {"structured_outputs": json.dumps(vllm_asdict)},  # Triton's OpenAI frontend
        {"guided_decoding": json.dumps({"json": schema_text, "disable_any_whitespace": True})},  # Triton <= 25.10
    ]
    specs = {SamplingParams.from_dict({"max_tokens": 8, **s}).structured_outputs for s in spellings}
    # Through the Triton contract: sampling_parameters is a JSON string, structured_outputs a JSON string in it.
    parsed = parse_inputs({"text_input": np.array([b"hi"], dtype=np.object_),
                           "sampling_parameters": np.array([json.dumps(spellings[1]).encode()], dtype=np.object_)})
    specs.add(parsed.params.structured_outputs)
    assert specs == {StructuredOutputSpec("json", json.dumps(SCHEMA, separators=(",", ":")), any_whitespace=False)}
    legacy = {"guided_json": ("json", schema_text), "guided_regex": ("regex", DATE),
              "guided_choice": ("choice", CHOICES), "guided_grammar": ("grammar", EBNF)}
    for key, (kind, value) in legacy.items():
        spec = SamplingParams.from_dict({key: value, "temperature": "0"}).structured_outputs
        assert spec is not None and spec.kind == kind
    assert SamplingParams.from_dict({"guided_json": None, "structured_outputs": None}).structured_outputs is None


@pytest.mark.parametrize(("values", "message"), [
    ({"guided_regex": "a+", "min_tokens": 2}, "min_tokens=2 cannot be combined with structured output"),
    ({"structured_outputs": {"regex": "a"}, "guided_choice": ["a"]}, "structured output was given more than once"),
    ({"structured_outputs": {"json": {"type": "string", "maxLength": 4}}}, "mlc-ai/xgrammar#800"),
    ({"structured_outputs": {"regex": "a", "whitespace_pattern": " "}}, "whitespace_pattern is not supported"),
    ({"guided_jsn": {}}, "unknown sampling parameter(s): guided_jsn"),
])
def test_requests_the_engine_cannot_honour_are_refused_before_it(values, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams.from_dict(values)


def test_a_model_without_tokenizer_or_eos_refuses_constraints():
    engine = LLMEngine(EngineConfig(model="gpt2-tiny"))  # a preset: no tokenizer.json, no EOS
    with pytest.raises(ValueError, match="structured output needs the model's tokenizer"):
        engine.add_request([1, 2], SamplingParams(structured_outputs={"regex": "a"}))


# ------------------------------------------------------------------------------- the engine's care
def test_failed_batches_aborts_and_finishes_leave_no_matcher_and_never_advance_one(checkpoint):
    """A batch that fails is re-run in halves (Scheduler.fail_batch) and nothing of it is recorded: a
    matcher advanced by a failed batch would put every later mask one token off. Requests ending in any
    way (stop, length, abort while compiling or running, a failed batch of their own) drop their matcher."""
    engine = LLMEngine(EngineConfig(model=checkpoint, max_num_seqs=8))
    executor = engine.core.executor
    collect, failures, calls = executor.collect_oldest, [], [0]

    def failing() -> object:  # before it runs, fails every batch holding "poison", and two decode batches
        meta = executor._pending[0]
        calls[0] += 1
        if "poison" in meta.scheduled_ids or calls[0] in (8, 9):
            executor._pending.popleft()
            failures.append(meta.scheduled_ids)
            raise RuntimeError("injected forward failure")
        return collect()

    executor.collect_oldest = failing
    names = ["json", "regex", "grammar", "poison", "long", "aborted-running", "aborted-compiling"]
    params = [constrained("json", temperature=1.0, seed=7), constrained("regex", temperature=0.0),
              constrained("grammar", temperature=1.0, seed=8), constrained("choice", temperature=0.0),
              SamplingParams(max_tokens=6, temperature=0.0, structured_outputs={"regex": "[a-z]+"}),
              constrained("json", temperature=0.0), constrained("regex", temperature=0.0)]
    events: dict[str, list[RequestOutput]] = {}
    engine.add_requests(["kalo mine to"] * len(params), params, names,
                        on_output=lambda e: events.setdefault(e.request_id, []).append(e))  # fmt: skip
    engine.abort_request("aborted-compiling")  # before the core has even seen it
    for _ in range(4):
        engine.step()
    engine.abort_request("aborted-running")
    while engine.has_work():
        engine.step()
    reasons = {name: events[name][-1].finish_reason for name in names}
    assert reasons == {"json": "stop", "regex": "stop", "grammar": "stop", "poison": "error", "long": "length",
                       "aborted-running": "cancelled", "aborted-compiling": "cancelled"}
    assert len(failures) == 5 and len(failures[3]) > 2, failures  # the poison's bisection, and mid-output failures
    executor.collect_oldest = collect
    for name, p in zip(names[:3], params[:3], strict=True):
        (out,) = run(engine, ["kalo mine to"], [p]).values()
        assert ids_of(events[name]) == ids_of(out)  # as if no batch had failed
        assert CASES[name][1](text_of(events[name]))
    assert_clean(engine)

def test_preemption_by_recompute_keeps_the_matcher_and_the_outputs(llm, checkpoint):
    """A small paged pool with chunked prefill preempts constrained requests mid-output; re-admitted, they
    prefill prompt and outputs again and go on from the matcher's state: the outputs are those of a
    pool that never preempts."""
    params = [constrained("json", temperature=0.0), constrained("json", temperature=1.0, seed=9),
              constrained("grammar", temperature=1.0, seed=10), constrained("regex", temperature=0.0)] * 2
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(params))]
    small = LLM(checkpoint, max_num_seqs=8, kv_policy="paged", block_size=4, kv_capacity_tokens=96,
                max_num_batched_tokens=7, kv_watermark=0.0)
    outs = small.generate(prompts, params)
    assert small.engine.stats().num_preemptions > 0
    assert [o.output_ids for o in outs] == [o.output_ids for o in llm.generate(prompts, params)]
    assert all(o.finish_reason == "stop" for o in outs)
    assert_clean(small.engine)


def test_tensor_parallel_workers_mask_as_one_process(checkpoint, llm):
    """The bitmask rows cross to the sampling rank as JSON (the other rank is sent none)."""
    prompts = ["hello there", "the cat sat on"]
    params = [constrained("json", temperature=1.0, seed=11),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)]
    tp2 = LLM(checkpoint, max_num_seqs=4, tensor_parallel_size=2)
    try:
        outs = tp2.generate(prompts, params)
    finally:
        tp2.engine.shutdown()
    assert [o.output_ids for o in outs] == [o.output_ids for o in llm.generate(prompts, params)]
    assert valid_person(outs[0].text)


# ---- bounds on what a constraint may cost (issue #29) ----------------------------------------------
def nested_array_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth - 1):
        schema = {"type": "array", "items": schema}
    return schema


def test_a_schema_past_the_depth_or_size_limit_is_refused_before_it_compiles(checkpoint):
    engine = LLMEngine(EngineConfig(model=checkpoint))  # the defaults: 64 levels, 64 KiB
    engine.validate("hi", SamplingParams(structured_outputs={"json": nested_array_schema(64)}))  # at the limit
    with pytest.raises(ValueError, match="nests 800 levels deep, more than this deployment's "
                                         "max_structured_output_depth of 64"):  # fmt: skip
        engine.validate("hi", SamplingParams(structured_outputs={"json": nested_array_schema(800)}))
    engine = LLMEngine(EngineConfig(model=checkpoint, max_structured_output_bytes=4096))
    wide = {"type": "object", "properties": {f"field{i}": {"type": "string"} for i in range(200)}}
    with pytest.raises(ValueError, match=r"holds \d+ bytes, more than this deployment's max_structured_output_bytes "
                                         "of 4096"):  # fmt: skip
        engine.validate("hi", SamplingParams(structured_outputs={"json": wide}))
    with pytest.raises(ValueError, match="max_structured_output_bytes"):
        engine.validate("hi", SamplingParams(structured_outputs={"choice": ["x" * 1000] * 5}))


@pytest.mark.parametrize("where", ["sampling_parameters", "structured_outputs", "guided_json"])
def test_json_nested_past_the_parser_is_invalid_input_not_an_internal_error(where):
    deep = "[" * 100_000 + "]" * 100_000
    text = deep if where == "sampling_parameters" else json.dumps({where: deep})
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_inputs({"input_ids": np.array([1, 2], np.int32), "sampling_parameters": np.array([text.encode()],
                                                                                            dtype=np.object_)})


def test_a_grammar_that_does_not_compile_in_time_fails_alone_and_the_others_compile(checkpoint, monkeypatch):
    """A compile past structured_output_compile_timeout_s ends its request with INVALID; the compile
    queued behind it moves to a fresh thread and its request runs. The stuck compile is held on an
    event the test releases at the end, so nothing here depends on how long a compile takes."""
    import threading

    from orca_backend.core import structured_output

    release, stuck_started = threading.Event(), threading.Event()
    original = structured_output.StructuredOutputCompiler.compile

    def compile(self, spec):
        if spec.kind == "regex" and spec.value == "z+":
            stuck_started.set()
            release.wait(60)
        return original(self, spec)

    monkeypatch.setattr(structured_output.StructuredOutputCompiler, "compile", compile)
    engine = LLMEngine(EngineConfig(model=checkpoint, structured_output_compile_timeout_s=0.5))
    try:
        stuck = engine.add_request("hi", SamplingParams(max_tokens=4, structured_outputs={"regex": "z+"}))
        engine.step()  # the core takes it in and its compile starts
        assert stuck_started.wait(30)
        behind = engine.add_request("hi", SamplingParams(max_tokens=32, temperature=0.0,
                                                         structured_outputs={"choice": CHOICES}))  # fmt: skip
        plain = engine.add_request([1, 2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        while engine.has_work():
            engine.step()
        stuck_events, behind_events, plain_events = list(stuck), list(behind), list(plain)
        assert stuck_events[-1].finish_reason == "invalid"
        assert "did not compile within 0.5 s (structured_output_compile_timeout_s)" in stuck_events[-1].error
        assert "".join(e.new_text for e in behind_events) in CHOICES and behind_events[-1].finish_reason == "stop"
        assert sum(len(e.new_token_ids) for e in plain_events) == 3
    finally:
        release.set()
        engine.shutdown()
