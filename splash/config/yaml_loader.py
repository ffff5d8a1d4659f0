"""Strict YAML → frozen-dataclass plumbing shared by the serving config (no torch).

* ``read_yaml_mapping`` reads a file whose top level must be a mapping; syntax errors name the line,
  duplicate keys are errors (PyYAML silently keeps the last one otherwise).
* ``check_fields`` is called from a config dataclass's ``__post_init__``: it type-checks and coerces every
  field (int → float, list → tuple, "64MiB" → bytes) and validates ``choices`` / ``min`` / ``max`` / ``gt``
  given in the field's metadata. Errors name the field as ``section.field`` and the expected type; the
  loader adds the file name in front.
* ``unknown_key_error`` builds the "unknown key ... did you mean ..." message.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml

from splash.models.config import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
               "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys in a mapping."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise ConfigError(f"line {key_node.start_mark.line + 1}: duplicate key {key!r} "
                              f"(first given on line {seen[key]})")
        seen[key] = key_node.start_mark.line + 1
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """Read ``path``; an empty file is ``{}``. Every failure is a ConfigError naming the path."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{p}: config file not found" if not p.exists() else f"{p}: not a regular file")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p}: cannot read ({e})") from None
    try:
        _check_keys(yaml.compose(text, Loader=_StrictLoader), ())
        data = yaml.load(text, Loader=_StrictLoader)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{p}{line}: YAML syntax error: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: top level must be a mapping of sections, got {type(data).__name__}")
    return data


def _check_keys(node: Any, path: tuple[str, ...]) -> None:
    """Every mapping key must be a scalar: a list or mapping as a key is an error naming the field it is under."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if not isinstance(key, yaml.ScalarNode):
                where = f"field {'.'.join(path)!r}" if path else "the top level"
                raise ConfigError(f"line {key.start_mark.line + 1}: {where} has a key that is a "
                                  f"{'list' if isinstance(key, yaml.SequenceNode) else 'mapping'}, not a name")
            _check_keys(value, path + (str(key.value),))
    elif isinstance(node, yaml.SequenceNode):
        for item in node.value:
            _check_keys(item, path)


def parse_size(value: str) -> int:
    """'64MiB' → 67108864, '2GB' → 2000000000, '4096' → 4096. Raises ValueError."""
    m = _SIZE_RE.match(value)
    if not m:
        raise ValueError(f"not a size: {value!r} (examples: 67108864, 64MiB, 2GiB)")
    unit = (m.group(2) or "").lower()
    unit = unit[:-1] if unit.endswith("b") else unit
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def suggest(key: str, candidates: Iterable[str]) -> str:
    """' (did you mean 'x'?)' or ''."""
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def unknown_key_error(key: Any, where: str, candidates: Iterable[str], elsewhere: dict[str, str]) -> ConfigError:
    """``elsewhere`` maps a key to its qualified name in another section, for a hint when misplaced."""
    cands = list(candidates)
    hint = suggest(str(key), cands)
    if not hint and str(key) in elsewhere:
        hint = f" (did you mean {elsewhere[str(key)]!r}? it belongs to another section)"
    return ConfigError(f"unknown key {key!r} in {where}{hint}; valid keys: {', '.join(cands)}")


def _type_name(tp: Any) -> str:
    args = typing.get_args(tp)
    if _is_union(tp):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if typing.get_origin(tp) is tuple:
        return f"list of {_type_name(args[0])}"
    return getattr(tp, "__name__", str(tp))


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _describe(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def coerce(value: Any, tp: Any, meta: dict[str, Any]) -> Any:
    """Return ``value`` converted to ``tp``; raise TypeError if it has the wrong type."""
    if _is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(value, arg, meta)
            except TypeError:
                pass
        raise TypeError
    if typing.get_origin(tp) is tuple:
        if not isinstance(value, (list, tuple)):
            raise TypeError
        return tuple(coerce(v, typing.get_args(tp)[0], {}) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and meta.get("size"):
            try:
                return parse_size(value)
            except ValueError:
                raise TypeError from None
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise TypeError


def _check_value(name: str, value: Any, meta: dict[str, Any]) -> None:
    choices = meta.get("choices")
    if choices is not None and value is not None:
        items = value if isinstance(value, tuple) else (value,)
        for item in items:
            if item not in choices:
                what = f"contains {item!r}, which" if isinstance(value, tuple) else f"= {item!r}"
                raise ConfigError(f"field {name!r} {what} is not one of {', '.join(map(repr, choices))}"
                                  + suggest(str(item), choices))
    if value is None or isinstance(value, (str, tuple, bool)):
        return
    if "min" in meta and value < meta["min"]:
        raise ConfigError(f"field {name!r} = {value!r} must be >= {meta['min']}")
    if "gt" in meta and value <= meta["gt"]:
        raise ConfigError(f"field {name!r} = {value!r} must be > {meta['gt']}")
    if "max" in meta and value > meta["max"]:
        raise ConfigError(f"field {name!r} = {value!r} must be <= {meta['max']}")


def check_fields(obj: Any, section: str) -> None:
    """Coerce and validate every field of the (frozen) dataclass ``obj``; ConfigError names the field."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        name = f"{section}.{f.name}"
        raw = getattr(obj, f.name)
        try:
            value = coerce(raw, hints[f.name], dict(f.metadata))
        except TypeError:
            extra = " (or a size such as '64MiB')" if f.metadata.get("size") else ""
            if isinstance(raw, float) and not math.isfinite(raw):
                extra = " (a finite number)"
            raise ConfigError(f"field {name!r} must be {_type_name(hints[f.name])}{extra}, "
                              f"got {_describe(raw)}") from None
        if value is not raw:
            object.__setattr__(obj, f.name, value)
        _check_value(name, value, dict(f.metadata))
