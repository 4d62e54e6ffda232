"""Sweep grids: `key=v1,v2` entries parsed, crossed into override lists, each point named."""

from __future__ import annotations

import hashlib
import itertools
import json
import re
from typing import Any

from train.core.config import fail


def _split_values(text: str) -> list[str]:
    """`a,[1,2],b` -> ['a', '[1,2]', 'b']: commas inside brackets or quotes do not split."""
    out, depth, quote, cur = [], 0, "", ""
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur)
            cur = ""
            continue
        cur += ch
    return [*out, cur]


def _value(text: str) -> Any:
    """An override value as YAML reads it (`null`, `[1,2]`, `0.5`, `medusa`)."""
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def parse_grid(key: str, items: list[str]) -> dict[str, list[Any]]:
    """['head=medusa,hydra', 'optim.lr=1e-3,3e-3'] -> {'head': [...], 'optim.lr': [...]}."""
    grid: dict[str, list[Any]] = {}
    for item in items:
        name, sep, values = str(item).partition("=")
        vals = [v.strip() for v in _split_values(values)]
        if not sep or not name.strip() or not all(vals):
            fail(key, item, "entries like 'head=medusa,hydra' (a key, '=', comma-separated values)")
        grid[name.strip()] = [_value(v) for v in vals]
    return grid


_SPECIAL = re.compile(r"[\s,=\[\]{}()'\":]")


def override_value(v: Any) -> str:
    """A value as hydra's override grammar reads it back (`None` -> `null`, lists as JSON,
    strings with special characters quoted)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list | dict):
        return json.dumps(v, separators=(",", ":"))
    s = str(v)
    if isinstance(v, str) and (not s or _SPECIAL.search(s)):
        return "'" + s.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return s


def grid_value_key(v: Any) -> str:
    """A grid value as matching compares it: `1e-3` (a command-line grid reads it as a string)
    and 0.001 (a sweep file's float) are one value, as are 1 and 1.0."""
    s = override_value(v)
    if isinstance(v, bool) or v is None:
        return s
    try:
        return repr(float(s))
    except ValueError:
        return s


def held_extras(
    extra: dict[str, dict[Any, list[str]]], grid: dict[str, list[Any]]
) -> tuple[dict[str, dict[Any, list[str]]], list[str]]:
    """`extra` (grid key -> value -> overrides) cut to the values `grid` holds, and the
    `key=value` entries it lost."""
    kept: dict[str, dict[Any, list[str]]] = {}
    dropped = []
    for key, by_value in extra.items():
        held = {grid_value_key(v) for v in grid.get(key, [])}
        for value, overrides in by_value.items():
            if grid_value_key(value) in held:
                kept.setdefault(key, {})[value] = overrides
            else:
                dropped.append(f"{key}={override_value(value)}")
    return kept, dropped


def _slug(overrides: list[str]) -> str:
    """A readable dir name: `head=hydra,head.num_layers=2` -> `head-hydra_head.num_layers-2`."""
    s = "_".join(o.replace("=", "-").replace(",", "-") for o in overrides) or "default"
    return re.sub(r"[^A-Za-z0-9._-]+", "", s)


def unique_slugs(groups: list[list[str]]) -> list[str]:
    """One dir name per override group, distinct for distinct groups: readable slugs, with a
    hash of the overrides where slugs would be cut short or would coincide."""
    slugs = [_slug(g) for g in groups]
    out = []
    for g, s in zip(groups, slugs, strict=True):
        if len(s) > 80 or slugs.count(s) > 1:
            digest = hashlib.sha1(json.dumps(g).encode()).hexdigest()[:8]
            s = f"{s[:80]}-{digest}"
        out.append(s)
    return out


def grid_points(grid: dict[str, list[Any]]) -> list[list[str]]:
    """Every combination of the grid's values, as override lists (in the grid's key order)."""
    return [
        [f"{k}={override_value(v)}" for k, v in zip(grid, combo, strict=True)]
        for combo in itertools.product(*grid.values())
    ]
