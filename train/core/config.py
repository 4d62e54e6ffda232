"""Config schemas' shared machinery: composing conf/, and validating it into pydantic models.

Every default lives in `conf/*.yaml`; a schema (a `ConfigModel`) only says which keys exist, their
types and the values allowed, so no default is ever written twice. Validation is strict (no "5"
for 5, no 1 for true) and refuses unknown keys. Its errors name the key, the value and what is
allowed: `config key 'data.max_length' = -5 is invalid: an integer >= 16 (tokens per sample)`.

hydra-core and omegaconf are imported inside the functions that compose: `evaluation/` uses the
schemas without them.
"""

from __future__ import annotations

import importlib.util
import os
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, NoReturn, TypeVar, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError

from train.core.errors import ConfigError, InvalidValue

M = TypeVar("M", bound="ConfigModel")


class ConfigModel(BaseModel):
    """A config schema: every key required (defaults live in conf/), unknown keys refused."""

    model_config = ConfigDict(extra="forbid", strict=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:  # built in code: the same messages as from conf/
            raise SchemaError(type(self), e.errors(include_url=False)) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-serialisable values."""
        return self.model_dump(mode="json")


class SchemaError(ConfigError):
    """Validation errors of one schema. pydantic also builds nested schemas through __init__,
    so an outer schema finds this inside its own errors and words it with the full key."""

    def __init__(self, cls: type[BaseModel], errors: list[dict], prefix: str = ""):
        self.cls, self.errors = cls, errors
        super().__init__(_message(cls, errors, prefix))


def fail(key: str, value: Any, allowed: str) -> NoReturn:
    """Reject `value` of `key` (relative to the schema being validated), saying what is allowed."""
    raise InvalidValue(key, value, allowed)


def check(ok: Callable[[Any], bool], allowed: str) -> AfterValidator:
    """A field constraint for `Annotated[type, check(...)]`: `allowed` is the error's text."""

    def validator(value: Any) -> Any:
        if not ok(value):
            raise ValueError(allowed)
        return value

    return AfterValidator(validator)


Positive = Annotated[int, check(lambda v: v >= 1, "a positive integer")]
NonNegative = Annotated[int, check(lambda v: v >= 0, "an integer >= 0")]
Fraction = Annotated[float, check(lambda v: 0 <= v < 1, "a number in [0, 1)")]


# -- validation -------------------------------------------------------------------------------
# pydantic's own wording is clear enough for the rest ("Input should be a valid integer")
_MESSAGES = {"bool_type": "expected true or false", "missing": "this key is required"}


def _strip(tp: Any) -> Any:
    """The annotation without Annotated and without `| None`."""
    if typing.get_origin(tp) is Annotated:
        return _strip(typing.get_args(tp)[0])
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return _strip(args[0])
    return tp


def describe(tp: Any) -> str:
    """A type as the user would write it: `true/false or 'auto'`, `int`."""
    tp = _strip(tp)
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp) if a is not type(None))
    if origin is Literal:
        return " or ".join(repr(c) for c in typing.get_args(tp))
    return "true/false" if tp is bool else getattr(origin or tp, "__name__", str(tp))


def _member(tp: Any, tag: Any) -> tuple[type[BaseModel], str] | None:
    """The member of a tagged union of schemas whose tag field is the Literal `tag`, and that
    field's name (`tree=preset` -> PresetTree, "kind")."""
    for member in typing.get_args(tp):
        if isinstance(member, type) and issubclass(member, BaseModel):
            for name, field in member.model_fields.items():
                ann = field.annotation
                if typing.get_origin(ann) is Literal and tag in typing.get_args(ann):
                    return member, name
    return None


def _walk(cls: type[BaseModel], loc: tuple) -> tuple[list[str], Any, type[BaseModel] | None, str]:
    """Follow an error location through the schema: (dotted path parts, the annotation there,
    the model holding the last key, the union tag passed: `kind=preset`). Other union-member
    tags that pydantic adds to `loc` (`bool`, "literal['auto']") are dropped."""
    path: list[str] = []
    tp: Any = cls
    owner = None
    tag = ""
    for part in loc:
        tp = _strip(tp)
        origin = typing.get_origin(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            owner = tp
            path.append(str(part))
            field = tp.model_fields.get(str(part))
            tp = field.annotation if field is not None else None
        elif origin is dict:
            path.append(str(part))
            tp = typing.get_args(tp)[1]
        elif origin is list and isinstance(part, int):
            path[-1] = f"{path[-1]}[{part}]" if path else f"[{part}]"
            tp = typing.get_args(tp)[0]
        elif origin in (Union, types.UnionType) and (hit := _member(tp, part)):
            tp, field_name = hit
            tag = f"{'.'.join([*path, field_name])}={part}"
        else:  # a union member's tag: the key is already complete
            break
    return path, tp, owner, tag


def _message(cls: type[BaseModel], errors: list[dict], prefix: str, tag: str = "") -> str:
    """One line per bad key: `config key '<prefix>.<key>' = <value> is invalid: <allowed>`.
    `tag`: the union choice these errors belong to (`tree.kind=preset`), for missing keys."""
    lines: list[str] = []
    by_key: dict[str, list[tuple[dict, Any, Any, str]]] = {}
    for e in errors:
        path, tp, owner, inner_tag = _walk(cls, e["loc"])
        by_key.setdefault(".".join(path), []).append((e, tp, owner, inner_tag))

    def full(key: str) -> str:
        return ".".join(p for p in (prefix, key) if p)

    for key, group in by_key.items():
        e, tp, owner, inner_tag = group[0]
        choice = full(inner_tag) if inner_tag else tag
        err = (e.get("ctx") or {}).get("error")
        if isinstance(err, InvalidValue):  # fail() in a model check: key relative to the model
            inner = ".".join(p for p in (key, err.key) if p)
            lines.append(str(InvalidValue(full(inner), err.value, err.allowed)))
            continue
        if isinstance(err, SchemaError):  # a nested schema: its keys below this one
            lines.append(_message(err.cls, err.errors, full(key), choice))
            continue
        if isinstance(err, ConfigError):  # raised by code a check called: already worded
            lines.append(str(err))
            continue
        if e["type"] == "extra_forbidden":
            allowed = f"unknown key; known keys are {', '.join(sorted(owner.model_fields))}"
        elif e["type"] == "missing" and choice:
            allowed = f"{choice} needs {full(key)}"
        elif len(group) > 1:
            allowed = f"expected {describe(tp)}"
        elif e["type"] == "literal_error":
            allowed = f"allowed values are {e['ctx']['expected']}"
        elif isinstance(err, ValueError):
            allowed = str(err)
        else:
            allowed = _MESSAGES.get(e["type"], e["msg"])
        value = None if e["type"] == "missing" else e.get("input")
        lines.append(str(InvalidValue(full(key), value, allowed)))
    return "\n".join(lines)


def validate(cls: type[M], data: Mapping[str, Any], prefix: str = "") -> M:
    """`data` (plain values) as a `cls`, or a ConfigError naming every bad key.

    `prefix` is where `data` sits in the whole config (`base` for a recorded base config)."""
    if not isinstance(data, Mapping):
        raise InvalidValue(prefix or cls.__name__, data, f"expected a mapping for {cls.__name__}")
    try:
        return cls.model_validate(dict(data))
    except ValidationError as e:
        raise SchemaError(cls, e.errors(include_url=False), prefix) from None


# -- composing conf/ ----------------------------------------------------------------------------
CONF_PACKAGE = "hydra_heads_conf"  # conf/ as installed (pyproject maps the package onto conf/)


def conf_dir() -> Path:
    """The `conf/` tree: $HYDRA_HEADS_CONF, else the one installed with the package."""
    env = os.environ.get("HYDRA_HEADS_CONF")
    if env:
        path = Path(env)
    else:
        spec = importlib.util.find_spec(CONF_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ConfigError(
                f"the config tree ({CONF_PACKAGE}) is not installed: reinstall hydra-heads "
                "(`pip install .` or `make setup`), or set HYDRA_HEADS_CONF to a conf/ directory"
            )
        path = Path(next(iter(spec.submodule_search_locations)))
    if not path.is_dir():
        raise ConfigError(f"config tree not found at {path}; set HYDRA_HEADS_CONF to conf/")
    return path


def register_resolvers() -> None:
    """`${conf_path:deepspeed/zero3.json}`: a file shipped in conf/, as an absolute path."""
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("conf_path"):
        OmegaConf.register_new_resolver("conf_path", lambda rel: str(conf_dir() / rel))


def compose(config_name: str, overrides: list[str] | None = None):
    """conf/<config_name>.yaml composed with `overrides`, exactly as the CLI composes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_resolvers()
    if GlobalHydra.instance().is_initialized():  # inside a running app: use its search path
        return hydra_compose(config_name=config_name, overrides=overrides or [])
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=overrides or [])


def group_defaults(group: str, option: str) -> dict[str, Any]:
    """The values of conf/<group>/<option>.yaml (its own defaults list applied), as a dict:
    what a schema built in code (an imported checkpoint, a recorded config) starts from."""
    return _group_node(group, option, {})


def _group_node(group: str, option: str, values: dict[str, Any]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    cfg = compose(f"{group}/{option}")
    node = OmegaConf.select(cfg, group.replace("/", "."))
    # `values` first, then resolve: they may replace keys that interpolate outside the group
    node = OmegaConf.merge(node if node is not None else cfg, values)
    return OmegaConf.to_container(node, resolve=True)


def from_group(cls: type[M], group: str, option: str, **values: Any) -> M:
    """A `cls` from conf/<group>/<option>.yaml with `values` replacing keys of it."""
    return validate(cls, _group_node(group, option, values), prefix=group)


def load(cfg: Any, cls: type[M], example: str | None = None) -> M:
    """A composed DictConfig (minus `hydra`) resolved and validated into `cls`.

    Every key still `???` is reported at once, with `example` (a working command line)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    missing = sorted(_missing(OmegaConf.to_container(cfg, resolve=False)))
    if missing:
        keys = ", ".join(f"'{k}'" for k in missing)
        verb = "is" if len(missing) == 1 else "are"
        what = "config key" if len(missing) == 1 else "config keys"
        msg = f"{what} {keys} {verb} required but not set: pass " + " ".join(
            f"{k}=VALUE" for k in missing
        )
        raise ConfigError(msg + (f"\n  e.g. {example}" if example else ""))
    try:
        data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as e:
        raise ConfigError(f"config cannot be resolved: {e}") from None
    data.pop("hydra", None)
    return validate(cls, data)


def _missing(node: Any, prefix: str = "") -> list[str]:
    """Dotted keys whose value is `???` (found without resolving any interpolation)."""
    if isinstance(node, dict):
        items = ((f"{prefix}.{k}" if prefix else str(k), v) for k, v in node.items())
    elif isinstance(node, list):
        items = ((f"{prefix}[{i}]", v) for i, v in enumerate(node))
    else:
        return [prefix] if node == "???" else []
    return [key for k, v in items if k != "hydra" for key in _missing(v, k)]


def resolved_yaml(cfg: Any) -> str:
    """The composed config as YAML, interpolations resolved: what each run writes beside it."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(cfg, resolve=True)
