"""Strict YAML → config plumbing (no torch): syntax errors name the line, duplicate keys are errors (PyYAML keeps
the last one otherwise), and pydantic's complaints become ConfigErrors naming ``section.field``."""
from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import ValidationError

from splash.errors import ConfigError

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
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is tuple:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return "a mapping"
    if origin is typing.Literal:
        return "one of " + ", ".join(map(repr, args))
    return getattr(tp, "__name__", str(tp))


def _describe(value: Any) -> str:
    return "null" if value is None else f"{type(value).__name__} {value!r}"


def field_error(e: ValidationError, section: str, cls: type) -> ConfigError:
    """The first error of validating a config section as a ConfigError naming the field and what it must be."""
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not isinstance(p, int) and p != "[key]"]
    kind, value, ctx = err["type"], err["input"], err.get("ctx", {})
    if not loc:   # raised by the section's own checks (__post_init__): the message names the fields
        return ConfigError(str(ctx.get("error", err["msg"])))
    name = ".".join([section, *loc])
    if kind == "literal_error":
        choices = re.findall(r"'([^']*)'", ctx["expected"])
        return ConfigError(f"field {name!r} = {value!r} is not one of {', '.join(map(repr, choices))}"
                           + suggest(str(value), choices))
    for key, op in (("ge", ">="), ("gt", ">"), ("le", "<=")):
        if key in ctx:
            return ConfigError(f"field {name!r} = {value!r} must be {op} {ctx[key]}")
    if kind == "value_error":
        return ConfigError(f"field {name!r}: {ctx['error']}")
    extra = " (a finite number)" if kind == "finite_number" else ""
    return ConfigError(f"field {name!r} must be {_type_name(cls.__pydantic_fields__[loc[0]].annotation)}{extra}, "
                       f"got {_describe(value)}")
