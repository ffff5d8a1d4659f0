"""Edge cases found by adversarial testing (one rank, no MPI; each test is fast).

- A pin that was deferred on an idle engine must not block a later, different pin: the idle engine must try it.
- `layout: auto` (the serving default) on a world size that does not divide the heads must start in a layout that
  can be built there (dp_attn/cp), not fail on tp.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splash.config.serve_config import ServeConfig, apply_overrides
from splash.distributed.communicator import SingleRankCommunicator
from splash.engine.engine import Engine
from splash.models.presets import preset_config
from splash.server.startup import build_engine, engine_args

LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def _idle_engine(world: int, layout: str, blocks: int) -> Engine:
    """An Engine over a stand-in runner: scheduling, has_work and the switch decision need no tensors or ranks."""
    runner = SimpleNamespace(block_size=4, layout=layout, cfg=preset_config("tiny-mla"), dtype=torch.float32,
                             layout_kv_dtypes=dict.fromkeys(LAYOUTS, "float32"))
    return Engine(runner, SimpleNamespace(size=world, rank=0), blocks, max_num_batched_tokens=16)


def test_repin_after_a_deferred_pin_switches_an_idle_engine():
    eng = _idle_engine(2, "dop", 12)   # 12 blocks cannot hold one layer's projection all-gather (40 blocks)
    eng.request_layout("dp_attn")
    assert eng.has_work()
    assert eng._switch_decision() is None and eng.control.deferrals == 1
    assert not eng.has_work()          # deferred while idle: nothing would change until work comes
    eng.request_layout("tp")           # DOP -> TP keeps the projections and there is no KV: it fits
    assert eng.has_work(), "the idle engine must try the new pin, not stay parked on the old deferral"
    d = eng._switch_decision()
    assert d is not None and d.dst == "tp"


def test_repin_after_deferral_then_auto_then_pin():
    eng = _idle_engine(2, "dop", 12)
    eng.request_layout("dp_attn")
    assert eng._switch_decision() is None
    eng.request_layout("auto")
    assert not eng.has_work()
    eng.request_layout("tp")
    assert eng.has_work() and eng._switch_decision().dst == "tp"


def test_auto_initial_layout_skips_head_sharded_layouts_that_do_not_divide():
    cfg = ServeConfig()
    assert engine_args(cfg).initial_layout() == "tp"
    assert engine_args(cfg).initial_layout(4, 8) == "tp"
    assert engine_args(cfg).initial_layout(3, 8) == "dp_attn"
    only = apply_overrides(cfg, {"allowed_layouts": ["dop", "cp"]})
    assert engine_args(only).initial_layout(3, 8) == "cp" and engine_args(only).initial_layout(2, 8) == "dop"
    pinned = apply_overrides(cfg, {"layout": "tp"})
    assert engine_args(pinned).initial_layout(3, 8) == "tp"   # a pinned layout is kept (and then fails clearly)


class _ThreeRanks(SingleRankCommunicator):
    size = 3   # building the engine needs no collective; only the world size matters here


def test_auto_server_engine_builds_on_three_ranks_with_eight_heads(tiny_ckpt):
    ckpt = tiny_ckpt("div3", intermediate_size=96, moe_intermediate_size=48)   # FFN shards over 3, heads do not
    comm = _ThreeRanks()
    cfg = apply_overrides(ServeConfig(), {"model": str(ckpt), "kv_cache_memory_bytes": 1 << 20})
    engine = build_engine(cfg, comm, comm)
    assert engine.layout == "dp_attn"
    from splash.errors import ConfigError
    with pytest.raises(ConfigError, match="tp"):
        build_engine(apply_overrides(cfg, {"layout": "tp"}), comm, comm)


class _FourRanks(SingleRankCommunicator):
    size = 4


def test_budget_with_no_page_in_an_allowed_layout_fails_at_startup():
    """At 4 ranks, 1 MB of fp8 KV budget cannot even hold dp_attn/cp's replicated projections: max_model_len would
    be 0 and every request rejected, so the server must refuse to start and say which field to change."""
    from splash.errors import ConfigError
    comm = _FourRanks()
    cfg = apply_overrides(ServeConfig(), {"layout": "dop", "kv_cache_memory_bytes": 1_000_000,
                                          "kv_cache_dtype": "fp8_e4m3", "block_size": 4})
    with pytest.raises(ConfigError, match=r"cache\.kv_cache_memory_bytes.*'dp_attn'.*allowed_layouts"):
        build_engine(cfg, comm, comm)
    engine = build_engine(apply_overrides(cfg, {"allowed_layouts": ["tp", "dop"]}), comm, comm)
    assert engine.max_model_len > 1 and engine.layout == "dop"
