"""Fixtures of the in-process server tests (server_util.in_process)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def engine():
    """A one-rank tiny-mla engine, shared by a module's tests (a file that changes its weights makes its own)."""
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    return LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=64).engine
