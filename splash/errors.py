"""Errors every layer may raise — a leaf module, so that nothing imports a package just for its error type."""
from __future__ import annotations


class ConfigError(ValueError):
    """A configuration (model config.json or serving YAML) is invalid; the message names file and field."""


class EngineBusy(ValueError):
    """The engine has requests running or waiting, and what was asked needs it idle."""
