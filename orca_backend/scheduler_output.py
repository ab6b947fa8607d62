"""What crosses between the engine core and the model runners each step, torch-free: the scheduler's
`SchedulerOutput` out, the sampler's `SamplerOutput` back (vLLM v1's SchedulerOutput and
ModelRunnerOutput, in this project's words).

A SchedulerOutput is a delta. Every runner (the one in the core's process, or each worker process)
keeps the state of every unfinished request it has been sent, in its persistent input batch
(worker/input_batch.py); a step brings only what changed since the one before:

- `new_requests`: a request's first step: its tokens, sampling parameters and blocks;
- `recorded_ids` / `recorded_tokens`: the tokens the core recorded since its last step (what the steps
  that landed sampled, one per request that sampled): every rank appends them, so the sampling rank
  holds nothing the others do not, and a step that failed recorded nothing;
- `grown_ids` / `grown_block_ids`: blocks appended to requests' tables (after a preemption, a whole
  new table);
- `preempted_ids`: requests that lost their blocks (preemption by recompute): a runner frees their
  rows and keeps their tokens and generator; a preempted request that is scheduled again takes a row
  again;
- `finished_ids`: requests that ended: a runner forgets them;
- `lora_loads`: adapters to put in slots (multi-LoRA), before the step's rows are taken.

The step's batch is `scheduled_ids`, in order, each running `num_scheduled_tokens` tokens from
position `num_computed`. Every rank gets the same message, so every rank holds the same rows; a
runner takes it in as it arrives (before the step's forward, whatever that then does), and the core
counts it as held once sent.

On the wire (a worker pool's pipes, and the Ray pool's TCP connections, which cross hosts in
plaintext) a step travels as msgpack, never pickled: a message injected on the way may be wrong, but
it cannot run code in a rank. `encode_step` writes each dataclass as the array of its fields, in
declaration order; `decode_step` rebuilds exactly the types the annotations name, field by field
(plain fields of any of these dataclasses are handled from `dataclasses.fields`, so a field added to
one travels without codec changes), and refuses anything else with a ValueError naming the field.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from orca_backend.lora import LoRARequest
from orca_backend.messages import TokenLogprobs
from orca_backend.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequest:
    """A request as the runners first see it."""

    request_id: str
    token_ids: list[int]  # its prompt and every output token recorded so far
    num_prompt_tokens: int
    block_ids: list[int]  # its K/V blocks, in context order
    params: SamplingParams
    seed: int  # its generator's seed: params.seed, or one the engine drew at arrival
    # The tokens that end it with "stop" (stop ids, EOS unless ignored): the sampler bans them while it is
    # short of min_tokens.
    stop_ids: list[int] = field(default_factory=list)
    lora_id: int = 0  # its adapter (LoRARequest.lora_id), resident when it runs; 0: none


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    scheduled_ids: list[str]  # the batch, in order
    num_scheduled_tokens: list[int]  # per scheduled request
    num_computed: list[int]  # per scheduled request: tokens whose K/V is in the cache before this step
    new_requests: list[NewRequest] = field(default_factory=list)
    recorded_ids: list[str] = field(default_factory=list)
    recorded_tokens: list[int] = field(default_factory=list)
    grown_ids: list[str] = field(default_factory=list)
    grown_block_ids: list[list[int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    # Structured output: the batch positions of constrained requests that sample this step, and their
    # grammars' token bitmask rows in that order (int32 words, ceil(vocab / 32) per row, as raw bytes;
    # worker/bitmask.py). Only the sampling rank of a worker pool is sent them.
    bitmask_rows: list[int] = field(default_factory=list)
    bitmask: bytes = b""
    # Async scheduling: the batch positions of requests run ahead of their last step, which has not
    # returned: their input token is the one that step samples, not yet recorded. The runner takes it
    # from that step's sampled ids on the device (always the step submitted just before this one).
    ahead_rows: list[int] = field(default_factory=list)
    # LoRA: adapters to load before this step, each into a slot (core/lora_slots.py), replacing the
    # one there; every request of the step whose adapter it is finds it resident.
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per scheduled request (one that samples nothing has a placeholder the core ignores)
    # One per request when any asked for logprobs (None for those that did not), else None.
    logprobs: list[TokenLogprobs | None] | None = None
    # LoRA adapters that could not be loaded on some rank since the last output, {lora_id: why} (the
    # reason fit for a client): the core ends their requests, whatever this step sampled for them.
    lora_failures: dict[int, str] = field(default_factory=dict)


# --------------------------------------------------------------------------------------- the wire


class WireFormatError(ValueError):
    """A control message that does not decode to what its annotations say, with the path to the
    offending value (`SchedulerOutput.new_requests[2].params.top_k`)."""

    def __init__(self, problem: str, path: str = "") -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.problem, self.path = problem, path

    def inside(self, step: str) -> WireFormatError:
        """The same error, seen from one level up (`step` is `.field` or `[index]`)."""
        return WireFormatError(self.problem, step + self.path)


def encode_step(step: SchedulerOutput) -> bytes:
    """A step as msgpack (see the module docstring). Raises TypeError for a value the wire does not
    carry (anything but the annotated dataclasses, lists, tuples, dicts, str, bytes, int, float,
    bool and None)."""
    return msgpack.packb(step, default=_fields_of, use_bin_type=True)


def decode_step(data: bytes) -> SchedulerOutput:
    """The SchedulerOutput `data` encodes; a ValueError (WireFormatError) naming what is wrong
    otherwise. Only the annotated types are ever built."""
    try:
        wire = msgpack.unpackb(data, raw=False, strict_map_key=False)  # logit_bias has int keys
    except ValueError as exc:  # msgpack's errors (malformed, truncated, extra data) are ValueErrors
        raise WireFormatError(f"not a msgpack message ({type(exc).__name__}: {exc})") from None
    try:
        return _decoder(SchedulerOutput)(wire)
    except WireFormatError as exc:
        raise exc.inside("SchedulerOutput") from None


def _fields_of(value: object) -> list[Any]:
    """msgpack's hook for what it cannot pack itself: a dataclass, as the list of its fields."""
    if not dataclasses.is_dataclass(value) or isinstance(value, type):
        raise TypeError(f"the control channel does not carry {type(value).__name__} values")
    return [getattr(value, name) for name in _field_names(type(value))]


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    names = tuple(f.name for f in dataclasses.fields(cls))
    if any(not f.init for f in dataclasses.fields(cls)):
        raise TypeError(f"{cls.__name__} has fields its constructor does not take: the wire cannot rebuild it")
    return names


Decoder = Callable[[Any], Any]
_SCALARS: dict[Any, tuple[type, ...]] = {int: (int,), float: (float, int), str: (str,), bytes: (bytes,),
                                         bool: (bool,), type(None): (type(None),)}  # fmt: skip


@functools.cache
def _decoder(hint: Any) -> Decoder:
    """The function that checks and rebuilds a wire value of type `hint`; TypeError for a type the
    wire does not carry (found when a message of it is first decoded)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if dataclasses.is_dataclass(hint):
        return _dataclass_decoder(hint)
    if hint in _SCALARS:
        return _scalar_decoder(hint)
    if origin is list:
        return _sequence_decoder(args[0], list)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return _sequence_decoder(args[0], tuple)
    if origin is tuple:
        return _fixed_tuple_decoder(args)
    if origin is dict:
        return _dict_decoder(*args)
    if origin in (typing.Union, types.UnionType):
        return _union_decoder(args)
    if origin is typing.Literal:
        return _literal_decoder(args)
    raise TypeError(f"the control channel does not carry values of type {hint!r}")


def _type_name(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _scalar_decoder(hint: type) -> Decoder:
    allowed = _SCALARS[hint]
    name = "null" if hint is type(None) else hint.__name__

    def decode(value: Any) -> Any:
        if type(value) not in allowed:  # exact types: a bool is no int here
            raise WireFormatError(f"expected {name}, got {_type_name(value)}")
        return value

    return decode


def _dataclass_decoder(cls: type) -> Decoder:
    names = _field_names(cls)
    hints = typing.get_type_hints(cls)
    decoders = [_decoder(hints[name]) for name in names]

    def decode(value: Any) -> Any:
        if type(value) is not list or len(value) != len(names):
            got = f"{len(value)} fields" if type(value) is list else _type_name(value)
            raise WireFormatError(f"expected {cls.__name__}'s {len(names)} fields, got {got}")
        kwargs = {}
        for name, item, field_decoder in zip(names, value, decoders, strict=True):
            try:
                kwargs[name] = field_decoder(item)
            except WireFormatError as exc:
                raise exc.inside(f".{name}") from None
        try:
            return cls(**kwargs)  # its own checks run too (SamplingParams validates itself)
        except (TypeError, ValueError) as exc:
            raise WireFormatError(f"not a valid {cls.__name__}: {exc}") from None

    return decode


def _sequence_decoder(item_hint: Any, kind: type) -> Decoder:
    kind_name = kind.__name__
    if item_hint in _SCALARS:  # token ids and the like: their types checked in one pass at C speed
        allowed = frozenset(_SCALARS[item_hint])

        def decode_scalars(value: Any) -> Any:
            if type(value) is not list:
                raise WireFormatError(f"expected a {kind_name}, got {_type_name(value)}")
            if not set(map(type, value)) <= allowed:
                index = next(i for i, v in enumerate(value) if type(v) not in allowed)
                raise WireFormatError(f"expected {item_hint.__name__}, got {_type_name(value[index])}", f"[{index}]")
            return value if kind is list else tuple(value)

        return decode_scalars
    item = _decoder(item_hint)

    def decode(value: Any) -> Any:
        if type(value) is not list:
            raise WireFormatError(f"expected a {kind_name}, got {_type_name(value)}")
        out = []
        for index, v in enumerate(value):
            try:
                out.append(item(v))
            except WireFormatError as exc:
                raise exc.inside(f"[{index}]") from None
        return out if kind is list else tuple(out)

    return decode


def _fixed_tuple_decoder(item_hints: tuple[Any, ...]) -> Decoder:
    items = [_decoder(h) for h in item_hints]

    def decode(value: Any) -> Any:
        if type(value) is not list or len(value) != len(items):
            got = f"{len(value)} items" if type(value) is list else _type_name(value)
            raise WireFormatError(f"expected a tuple of {len(items)}, got {got}")
        out = []
        for index, (item, v) in enumerate(zip(items, value, strict=True)):
            try:
                out.append(item(v))
            except WireFormatError as exc:
                raise exc.inside(f"[{index}]") from None
        return tuple(out)

    return decode


def _dict_decoder(key_hint: Any, value_hint: Any) -> Decoder:
    key_decoder, value_decoder = _decoder(key_hint), _decoder(value_hint)

    def decode(value: Any) -> Any:
        if type(value) is not dict:
            raise WireFormatError(f"expected a dict, got {_type_name(value)}")
        out = {}
        for k, v in value.items():
            try:
                out[key_decoder(k)] = value_decoder(v)
            except WireFormatError as exc:
                raise exc.inside(f"[{k!r}]") from None
        return out

    return decode


def _union_decoder(members: tuple[Any, ...]) -> Decoder:
    decoders = [_decoder(m) for m in members if m is not type(None)]
    nullable = type(None) in members
    names = " | ".join("null" if m is type(None) else getattr(m, "__name__", repr(m)) for m in members)

    def decode(value: Any) -> Any:
        if value is None and nullable:
            return None
        errors = []
        for member in decoders:
            try:
                return member(value)
            except WireFormatError as exc:
                errors.append(exc)
        deepest = max(errors, key=lambda e: len(e.path))  # the member it came closest to being
        if deepest.path:
            raise deepest
        raise WireFormatError(f"expected {names}, got {_type_name(value)}")

    return decode


def _literal_decoder(values: tuple[Any, ...]) -> Decoder:
    def decode(value: Any) -> Any:
        if not any(type(v) is type(value) and v == value for v in values):
            raise WireFormatError(f"expected one of {', '.join(map(repr, values))}, got {value!r}"[:200])
        return value

    return decode
