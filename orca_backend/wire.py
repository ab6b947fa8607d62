"""Control messages on the wire, as msgpack, never pickled: a worker pool's pipes and the Ray pool's
TCP connections (which cross hosts in plaintext) carry them, and a message injected on the way may
be wrong but cannot run code in a rank.

`encode` writes each dataclass as the array of its fields, in declaration order; `decode` rebuilds
exactly the types the annotations name, field by field (plain fields are handled from
`dataclasses.fields`, so a field added to a message travels without changes here), through their
constructors (which run their own checks), and refuses anything else with a ValueError naming the
path to the offending value.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

T = TypeVar("T")


class WireFormatError(ValueError):
    """A control message that does not decode to what its annotations say, with the path to the
    offending value (`SchedulerOutput.new_requests[2].params.top_k`)."""

    def __init__(self, problem: str, path: str = "") -> None:
        super().__init__(f"{path}: {problem}" if path else problem)
        self.problem, self.path = problem, path

    def inside(self, step: str) -> WireFormatError:
        """The same error, seen from one level up (`step` is `.field` or `[index]`)."""
        return WireFormatError(self.problem, step + self.path)


def encode(value: object) -> bytes:
    """A dataclass value as msgpack (see the module docstring). Raises TypeError for a value the wire
    does not carry (anything but dataclasses, lists, tuples, dicts, str, bytes, int, float, bool and
    None)."""
    return msgpack.packb(value, default=_fields_of, use_bin_type=True)


def decode(data: bytes, cls: type[T]) -> T:
    """The `cls` value `data` encodes; a ValueError (WireFormatError) naming what is wrong otherwise.
    Only the types `cls`'s annotations name are ever built."""
    try:
        wire = msgpack.unpackb(data, raw=False, strict_map_key=False)  # dicts may have int keys (logit_bias)
    except ValueError as exc:  # msgpack's errors (malformed, truncated, extra data) are ValueErrors
        raise WireFormatError(f"not a msgpack message ({type(exc).__name__}: {exc})") from None
    try:
        return _decoder(cls)(wire)
    except WireFormatError as exc:
        raise exc.inside(cls.__name__) from None


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
