"""Typed config dataclasses from plain mappings, with errors that name the key, value and fix."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, TypeVar, Union

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is missing, of the wrong type, or not allowed."""


def fail(key: str, value: Any, allowed: str) -> typing.NoReturn:
    """Raise a ConfigError naming the key, the value found and what is allowed."""
    raise ConfigError(f"config key '{key}' = {value!r} is invalid: {allowed}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; return it (converted where lossless)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            fail(key, value, f"a value of type {_name(tp)} is required")
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(key, value, arg)
            except ConfigError as e:
                errors.append(e)
        fail(key, value, f"expected {_name(tp)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            fail(key, value, f"allowed values are {', '.join(repr(c) for c in choices)}")
        return value
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value):
            return value
        if not isinstance(value, Mapping):
            fail(key, value, f"expected a mapping for {tp.__name__}")
        return from_mapping(tp, value, prefix=key)
    if origin in (list, tuple) or tp in (list, tuple):
        if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)):
            fail(key, value, f"expected a list ({_name(tp)})")
        args = typing.get_args(tp)
        inner = args[0] if args else Any
        return [_coerce(f"{key}[{i}]", v, inner) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            fail(key, value, f"expected a mapping ({_name(tp)})")
        args = typing.get_args(tp)
        kt, vt = args if args else (Any, Any)
        return {_coerce(key, k, kt): _coerce(f"{key}.{k}", v, vt) for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        fail(key, value, "expected true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(key, value, "expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(key, value, "expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(key, value, "expected a string")
        return value
    if isinstance(tp, type) and not isinstance(value, tp):
        fail(key, value, f"expected {_name(tp)}")
    return value


def _name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_name(a) for a in typing.get_args(tp))
    if origin is Literal:
        return " or ".join(repr(c) for c in typing.get_args(tp))
    if tp is bool:
        return "true/false"
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def from_mapping(cls: type[T], data: Mapping[str, Any], prefix: str = "") -> T:
    """Build dataclass `cls` from `data`, rejecting unknown keys and values of the wrong type.

    Field-level checks run here; `__post_init__` of `cls` then checks value ranges and
    combinations. `prefix` is the dotted config path used in error messages (`data`, `base`).
    """
    if not isinstance(data, Mapping):
        fail(prefix or cls.__name__, data, f"expected a mapping for {cls.__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        key = f"{prefix}.{unknown[0]}" if prefix else unknown[0]
        fail(key, data[unknown[0]], f"unknown key; known keys are {', '.join(sorted(fields))}")
    kwargs = {}
    for name, f in fields.items():
        key = f"{prefix}.{name}" if prefix else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                fail(key, None, "this key is required")
            continue
        kwargs[name] = _coerce(key, data[name], hints[name])
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if prefix and not str(e).startswith(f"config key '{prefix}."):
            # __post_init__ names keys relative to its own dataclass; make them absolute.
            raise ConfigError(str(e).replace("config key '", f"config key '{prefix}.", 1)) from None
        raise


def to_dict(obj: Any) -> dict[str, Any]:
    """A dataclass as a plain JSON/YAML-serialisable dict."""
    return dataclasses.asdict(obj)
