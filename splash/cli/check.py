"""``splash-serve --config X --check``: validate a serving config on this machine and print what would run.

One process, no MPI job, no weights read (a model directory that is not here is the splash-sim preset named like
`server.served_model_name`). Exit 0 when the config is valid, even if this machine lacks the hardware (the report
says what start would refuse); exit 2 for an invalid config.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from splash.errors import ConfigError

GIB = 1 << 30
_SIM_QUANT = {"fp8_e4m3": "fp8", "int8": "int8"}   # a sim preset's weight dtype -> the memory model's weight_quant


def _model(cfg) -> tuple[Any, str, str | None]:
    """(ModelConfig for the memory model or None, where it came from, why it cannot be served here or None)."""
    from splash.sim.presets import PRESETS, load_sim_model

    m = cfg.model
    if not m.model:
        from splash.models.presets import preset_config
        try:
            return preset_config(m.preset), f"preset {m.preset!r}", None
        except ValueError as e:
            raise ConfigError(f"field 'model.preset': {e}") from None
    loadable = None
    if (Path(m.model) / "config.json").is_file():
        from splash.models.loader import load_model_config
        try:
            load_model_config(m.model)
        except ConfigError as e:
            loadable = str(e)
        try:
            return load_sim_model(m.model).cfg, f"{m.model}/config.json", loadable
        except ConfigError as e:
            return None, m.model, str(e)
    missing = f"model directory {m.model} is not on this machine"
    name = (cfg.server.served_model_name or Path(m.model).name).lower()
    if name in PRESETS:
        sim = load_sim_model(name)
        extra = f", {sim.weight_dtype} weights" + (f", +{sim.linear_layers} linear-attention layers outside this "
                                                   "budget" if sim.linear_layers else "")
        quant = _SIM_QUANT.get(sim.weight_dtype)
        mcfg = dataclasses.replace(sim.cfg, quantization=sim.cfg.quantization or quant)
        return mcfg, f"splash-sim preset {name!r}{extra} ({missing})", missing
    return None, m.model, missing


def _backend_line(cfg):
    """(cfg with `auto` resolved, the backend line, what start would refuse or None)."""
    import backends
    from splash.config.serve_config import apply_overrides

    asked = cfg.parallel.backend
    try:
        b = backends.get_backend(asked)
    except backends.BackendUnavailable as e:
        return cfg, f"{asked} (not available here)", str(e)
    if b.name != asked:
        cfg = apply_overrides(cfg, {"backend": b.name}, source="parallel.backend: auto")
    line = f"{asked} -> {b.describe()}"
    try:
        backends.check_attention(b.name, cfg.attention_backend)
    except backends.BackendUnavailable as e:
        return cfg, line, str(e)
    from splash.server.startup import profile_from_device
    return profile_from_device(cfg, b), line, None


def _world(cfg, profile) -> tuple[int, str]:
    if cfg.parallel.world_size:
        return cfg.parallel.world_size, "parallel.world_size"
    w = (profile.extra or {}).get("world") if profile is not None else None
    if w:
        return int(w), f"{profile.name} profile group; mpirun -n decides at start"
    return 1, "one rank; mpirun -n decides at start"


def _budget(cfg, mcfg, world: int, profile, out: list[str]) -> None:
    from splash.attention.kernels import rope_fp8_pool
    from splash.layouts.ownership import distinct_kv_tokens
    from splash.server.startup import device_budget, engine_args

    c, args = cfg.cache, engine_args(cfg)   # start sizes the pool from the same settings (splash.engine.build)
    kv = args.pool_kv_dtype(mcfg)
    arch = profile.device_arch if profile is not None and cfg.parallel.backend != "cpu" else ""
    if c.kv_cache_memory_bytes or cfg.parallel.backend == "cpu":
        pool = args.kv_cache_memory_bytes
        out.append(f"memory    KV budget {pool / GIB:.3f} GiB per rank (cache.kv_cache_memory_bytes)")
    elif not (profile and profile.memory_bytes):
        out.append(f"memory    device memory unknown here (no hardware profile with memory_bytes); at start: "
                   f"{c.gpu_memory_utilization:g} x the measured device memory (splash.layouts.device_budget)")
        return
    else:
        try:
            b = device_budget(cfg, mcfg, world, int(profile.memory_bytes), 0, args.weight_bytes, arch)
        except ValueError as e:
            out.append(f"memory    does not fit: {e}")
            return
        where = f", device arch {arch}" if arch else ""
        out.append(f"memory    per rank, device memory from the {profile.name} profile{where} (measured at start):")
        out += [f"            {name:22s} {v / GIB:9.2f} GiB" for name, v in b.rows()]
        pool = b.kv_pool_bytes
    rope_fp8 = rope_fp8_pool(cfg.attention_backend, arch)
    per = args.kv_blocks(mcfg, world, pool, rope_fp8)
    caps = ", ".join(f"{lay} {distinct_kv_tokens(lay, n, cfg.block_size, world):,}" for lay, n in per.items()
                     if lay in cfg.layout.allowed_layouts)
    rope = " (rope key in e4m3: FlashInfer's FP8 MLA)" if rope_fp8 and kv == "fp8_e4m3" else ""
    out.append(f"KV        {kv}{rope}, {cfg.block_size}-token pages; distinct tokens the group holds: {caps}")


def report(cfg) -> tuple[list[str], list[str]]:
    """(lines to print, problems start would refuse on this machine)."""
    from splash.costmodel.profile import load_profile
    from splash.layouts.layout import heads_fit

    problems: list[str] = []
    mcfg, source, unservable = _model(cfg)
    if unservable:
        problems.append(unservable)
    cfg, backend, why = _backend_line(cfg)
    if why:
        problems.insert(0, why)
    hp = cfg.hardware_profile
    profile = load_profile(hp) if hp else None
    world, wsrc = _world(cfg, profile)
    out = [f"config    valid ({cfg.model_name})",
           f"model     {source}" + (f": {mcfg.model_type}, {mcfg.num_hidden_layers} MLA layers, "
                                    f"{mcfg.num_attention_heads} heads" if mcfg else ""),
           f"ranks     {world} ({wsrc})",
           f"backend   {backend}; attention {cfg.parallel.attention_backend or 'default'} -> {cfg.attention_backend}"
           f"; compute {cfg.compute_dtype}; profile {hp or 'none (auto stays in its start layout)'}"
           + (' (from the GPU\'s name)' if hp and cfg.layout.hardware_profile is None else '')]
    if cfg.parallel.backend == "cpu":
        from splash import native
        out.append(f"kernels   {native.describe(threads=1)} with one rank per core; torch's with more threads")
    if mcfg is not None:
        fit = [a for a in cfg.layout.allowed_layouts if heads_fit(a, mcfg.num_attention_heads, world)]
        out.append(f"layouts   {cfg.layout.layout} over {', '.join(fit) or 'none'} ({cfg.layout.switch_mode} "
                   f"switches, margin {cfg.layout.switch_margin:g})")
        _budget(cfg, mcfg, world, profile, out)
    return out, problems


def run_check(argv) -> int:
    from splash.cli.args import build_config
    cfg = build_config(argv)
    lines, problems = report(cfg)
    print("\n".join(lines))
    if problems:
        print("start would fail here:\n" + "\n".join(f"  - {p}" for p in problems))
    else:
        print("start: nothing missing on this machine")
    return 0
