"""Command-line entry points (``splash-serve``); flag parsing lives in ``args``."""
