"""Command-line entry points (``splash-serve``); flag parsing lives in ``args``."""
from splash.cli.args import build_config, build_parser, main_guard

__all__ = ["build_config", "build_parser", "main_guard"]
