"""parallel.communicator: its default per backend, validation naming the field, the --communicator flag, and
the startup check that refuses a communicator this machine cannot run before any rank enters a collective."""
from __future__ import annotations

import pytest
import torch

from splash.cli.args import build_config, build_parser
from splash.config.serve_config import ServeConfig, apply_overrides, load_serve_config
from splash.errors import ConfigError
from splash.server import startup


@pytest.mark.parametrize("backend, want", [("cpu", "mpi"), ("cuda", "torch"), ("hip", "torch")])
def test_default_follows_the_backend(backend, want):
    cfg = apply_overrides(ServeConfig(), {"backend": backend})
    assert cfg.parallel.communicator is None and cfg.communicator == want


def test_explicit_value_wins_and_flag_overrides_yaml(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("parallel:\n  communicator: torch\n")
    assert load_serve_config(p).communicator == "torch"
    assert build_config(["--config", str(p), "--communicator", "mpi"]).communicator == "mpi"
    assert apply_overrides(ServeConfig(), {"backend": "cuda", "communicator": "mpi"}).communicator == "mpi"


def test_bad_value_names_the_field(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("parallel:\n  communicator: nccl\n")
    with pytest.raises(ConfigError, match=r"parallel\.communicator.*'nccl'.*'mpi', 'torch'"):
        load_serve_config(p)
    with pytest.raises(ConfigError, match="--communicator"):
        build_config(["--communicator", "gloo"])


def test_help_lists_the_flag():
    text = build_parser().format_help()
    assert "--communicator {mpi,torch}" in text and "gloo on cpu" in text


def test_startup_check_names_the_field():
    startup.check_communicator(apply_overrides(ServeConfig(), {"communicator": "torch"}))  # gloo: always here
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"field 'parallel\.communicator' = 'torch'.*needs NCCL/RCCL"):
            startup.check_communicator(apply_overrides(ServeConfig(), {"backend": "cuda"}))
