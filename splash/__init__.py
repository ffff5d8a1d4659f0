"""SPLASH: an MLA serving engine that switches the attention layout while requests run.

The vLLM-style offline API is importable from the top level — ``from splash import LLM, SamplingParams`` —
and loaded lazily (PEP 562 ``__getattr__``), so importing a pure module such as ``splash.layouts`` or
``splash.config`` never imports torch.
"""
from __future__ import annotations

from typing import Any

_LAZY = {
    "LLM": "splash.engine.llm",
    "RequestOutput": "splash.engine.llm",
    "CompletionOutput": "splash.engine.llm",
    "SamplingParams": "splash.engine.sampling",
}
__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'splash' has no attribute {name!r}")
    import importlib
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
