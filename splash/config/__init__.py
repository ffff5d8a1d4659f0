"""Serving configuration: YAML → frozen dataclasses, CLI overrides (see ``serve_config``)."""
from splash.config.serve_config import (
    CacheSection,
    LayoutSection,
    ModelSection,
    ParallelSection,
    SchedulerSection,
    ServeConfig,
    ServerSection,
    apply_overrides,
    load_serve_config,
    serve_config_from_dict,
)
from splash.models.config import ConfigError

__all__ = [
    "CacheSection", "ConfigError", "LayoutSection", "ModelSection", "ParallelSection", "SchedulerSection",
    "ServeConfig", "ServerSection", "apply_overrides", "load_serve_config", "serve_config_from_dict",
]
