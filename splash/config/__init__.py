"""Serving configuration: YAML → frozen dataclasses, CLI overrides (see ``serve_config``)."""
