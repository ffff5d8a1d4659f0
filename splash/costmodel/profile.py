"""Hardware profiles of the cost model: the rates a step's work is divided by. Pure data, no torch.

A profile is a YAML file (configs/hardware/<name>.yaml, or any path). Every key is required except those
with a default below; an unknown key is an error naming it. Names ("cpu", "h200", "b200", "bw1000") resolve
to ``configs/hardware`` of this checkout (found relative to this file — the package is installed editable from
the checkout, ``make install``), or to ``$SPLASH_HARDWARE_DIR`` when set.
"""
from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from splash.config.yaml_loader import read_yaml_mapping, unknown_key_error
from splash.layouts.layout import LAYOUT_NAMES
from splash.models.config import ConfigError

GEMM_DTYPES = ("float32", "bfloat16", "fp8_e4m3", "int8")
COLLECTIVES = ("all_reduce", "all_gather", "all_to_all", "broadcast")
COMBINES = ("max", "sum")
KV_VOLUMES = ("received", "logical")
OVERLAPS = ("budget", "pipeline")
CONTENTIONS = ("link", "memory")
PROVENANCE_KINDS = ("spec", "fitted", "measured", "assumed")


@dataclass(frozen=True)
class Collective:
    """Time of one collective = ``alpha_s + bytes / bytes_per_s``.

    ``bytes`` is what the cost model and ``splash-bench calibrate`` both use: all_reduce and broadcast the
    buffer, all_gather the gathered output (all ranks' parts), all_to_all the larger of one rank's send and
    receive totals."""
    alpha_s: float
    bytes_per_s: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + max(0.0, nbytes) / self.bytes_per_s


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    source: str                          # where the numbers come from (datasheet, calibrate run)
    gemm_flops_per_s: Mapping[str, float]  # dense GEMM rate per weight dtype
    memory_bytes_per_s: float            # weight / activation streaming bandwidth
    attention_flops_per_s: float         # MLA attention (score + value) rate
    kv_read_bytes_per_s: float           # KV history read rate
    collectives: Mapping[str, Collective]
    attention_combine: str = "max"       # max: the kernel streams KV while computing; sum: gather, then compute
    overlap_fraction: float = 0.0        # share of attention time that may hide the layer's exchanges
    op_overhead_s: float = 0.0           # fixed host cost per kernel / eager op
    plan_block_s: float = 0.0            # host cost per KV block entry of the per-step attention plan
    plan_request_s: float = 0.0          # host cost per request of the per-step attention plan
    step_overhead_s: float = 0.0         # fixed cost per step (scheduling, sampling)
    memory_bytes: float = 0.0            # device memory per rank (0: not modelled, e.g. CPU)
    ops_scale: float = 1.0               # eager op counts × this (0.0 ≈ graphs / fused kernels)
    moe_grouped: bool = False            # MoE runs as grouped GEMM kernels (no per-expert op cost)
    # the attention walks each query row's own visible keys, every row of a step in one call a layer (SPLASH's
    # CPU kernel, splash.native): no padding to the longest history, causal prefill rows, no chunk structure
    attention_row_kernel: bool = False
    # SPLASH's fused CPU kernels run (splash.native): op counts of the fused path (splash/costmodel/op_counts.py)
    fused_kernels: bool = False
    attention_call_s: float = 0.0        # fixed host cost of one attention call (replaces its op count)
    attention_scratch_bytes: float = 0.0  # split-KV kernel chunk budget (0: attention gathers whole histories)
    alloc_threshold_bytes: float = 0.0   # temporaries at least this big are fresh pages each time (0: none)
    alloc_bytes_per_s: float = 0.0       # rate of first-touching fresh pages (glibc mmap'd temporaries)
    # split-KV kernel structure (0 = not modelled):
    attention_merge_bytes_per_s: float = 0.0  # rate of a multi-chunk group's running-output merge traffic
    attention_cache_bytes: float = 0.0        # cache share of one rank: a chunk working set above it spills
    attention_spill_bytes_per_s: float = 0.0  # rate of re-reading the spilled part of a gathered chunk
    # per collective inside a real step, beyond the isolated α + bytes/β that calibrate times after a barrier
    # (0: not modelled). `splash-bench calibrate` fits it as the per-collective residual of real steps (which then
    # also carries the wait for the peer, in proportion to the collective count); with --in-step-collectives it is
    # the collective's own time on the last rank to arrive, and the wait is collective_wait_fraction's
    collective_sync_s: float = 0.0
    # waiting for the slower peer inside a step (the ranks' drift between collectives), as a fraction of a rank's
    # time outside collectives; charged once per step that has a collective, whatever their number (0: none)
    collective_wait_fraction: float = 0.0
    # GEMM rate by row count per weight dtype ({dtype: {rows: FLOP/s}}, interpolated in log rows; empty: the
    # flat gemm_flops_per_s at every row count)
    gemm_rows_flops_per_s: Mapping[str, Mapping[int, float]] = field(default_factory=dict)
    # fixed cost per step of each layout on top of step_overhead_s (its Python, metadata and exchange set-up at
    # this world size; empty: none)
    step_overhead_layout_s: Mapping[str, float] = field(default_factory=dict)
    # measured / predicted attention of a prefill chunk inside a real step, per layout (calibrate: one 512-token
    # chunk on every rank's executor; missing: 1). Scales the prefill pieces' attention work, not decode rows'.
    prefill_attention_factor: Mapping[str, float] = field(default_factory=dict)
    # ---- links and switch primitives (0 / the first choice: not modelled, the collectives table prices switches)
    link_bytes_per_s: float = 0.0        # one direction of one rank's intra-node link (spec sheet)
    inter_node_bytes_per_s: float = 0.0  # one direction of one rank's inter-node link (its NIC, spec sheet)
    # share of link_bytes_per_s a switch's per-layer KV collective / projection all-gather reaches
    switch_kv_efficiency: float = 0.0
    switch_weight_efficiency: float = 0.0
    # the bytes a KV switch collective moves per rank: "received" (the manifest's state difference) or "logical"
    # ((T-1)/T of the layer's whole live KV, whatever share a rank keeps: splash/costmodel/switch_cost.py)
    switch_kv_volume: str = "received"
    # how a live switch hides: "budget" (later layers hide behind overlap_fraction of a destination layer) or
    # "pipeline" (each layer's transfer runs under the previous layer's whole computation and shares the link
    # with the step's own collectives; splash/costmodel/switch_cost.py)
    switch_overlap: str = "budget"
    switch_handoff_s: float = 0.0     # pipeline: the fixed cost of a live handoff (a discard-only switch's p50)
    # pipeline: what a hidden transfer slows the step by. "link": it shares the link with the step's collectives
    # (switch_contention = their delay per second of hidden transfer, in proportion to the step's collective share);
    # "memory": its bytes cross HBM while the step computes (switch_contention = the step's delay per second those
    # bytes take at memory_bytes_per_s). splash/costmodel/switch_cost.py
    switch_contention_on: str = "link"
    switch_contention: float = 0.0
    # a blocking switch's time over its per-layer primitives back to back (1: the primitives alone)
    switch_blocking_factor: float = 1.0
    # where each number comes from: field (or "extra.<key>") -> "spec: ...", "fitted: ... (to what)", "measured: ..."
    # or "assumed: ..."
    provenance: Mapping[str, str] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)  # free-form notes (e.g. calibrate's raw fits)
    # the GPU's arch ("sm_90", "sm_100", "gfx942"; "" unknown): `splash-serve --check` sizes the KV pool and the
    # attention kernel's workspaces for the path that runs there (at start the device's own arch is read)
    device_arch: str = ""

    def gemm_rate(self, dtype: str) -> float:
        if dtype not in self.gemm_flops_per_s:
            raise ValueError(f"hardware profile {self.name!r} has no GEMM rate for {dtype!r} "
                             f"(has: {', '.join(self.gemm_flops_per_s)})")
        return self.gemm_flops_per_s[dtype]

    def gemm_rate_at(self, dtype: str, rows: float) -> float:
        """GEMM rate for ``rows`` query rows: the row-count table when the profile has one for ``dtype``
        (log-linear between measured row counts, flat beyond them), else the flat rate."""
        table = self.gemm_rows_flops_per_s.get(dtype)
        if not table:
            return self.gemm_rate(dtype)
        pts = sorted(table.items())
        if rows <= pts[0][0]:
            return pts[0][1]
        for (r0, v0), (r1, v1) in zip(pts, pts[1:]):
            if rows <= r1:
                f = (math.log(rows) - math.log(r0)) / (math.log(r1) - math.log(r0))
                return math.exp(math.log(v0) + f * (math.log(v1) - math.log(v0)))
        return pts[-1][1]

    def collective(self, kind: str) -> Collective:
        return self.collectives[kind]

    def collective_seconds(self, kind: str, nbytes: float) -> float:
        """One collective of ``nbytes`` (as `Collective` counts them): α + bytes/β, plus first-touching its
        result when that is a fresh allocation (at least ``alloc_threshold_bytes``: every communicator call
        allocates its output: on the cpu profile that doubles-to-triples a 64 MB collective's time,
        docs/benchmarks.md)."""
        t = self.collectives[kind].seconds(nbytes)
        if self.alloc_bytes_per_s > 0 and nbytes >= self.alloc_threshold_bytes:
            t += nbytes / self.alloc_bytes_per_s
        return t

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "collectives":
                v = {k: {"alpha_s": c.alpha_s, "bytes_per_s": c.bytes_per_s} for k, c in v.items()}
            elif f.name == "gemm_rows_flops_per_s":
                v = {d: {int(r): float(x) for r, x in t.items()} for d, t in v.items()}
            elif isinstance(v, Mapping):
                v = dict(v)
            out[f.name] = v
        return out


_REQUIRED = ("name", "source", "gemm_flops_per_s", "memory_bytes_per_s", "attention_flops_per_s",
             "kv_read_bytes_per_s", "collectives")


def _positive(where: str, key: str, v: Any, allow_zero: bool = False) -> float:
    if isinstance(v, str):  # PyYAML (YAML 1.1) reads 1.1e15 without a sign in the exponent as a string
        try:
            v = float(v)
        except ValueError:
            pass
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where}: field {key!r} must be a number, got {v!r}")
    if v < 0 or (v == 0 and not allow_zero):
        raise ConfigError(f"{where}: field {key!r} must be {'>= 0' if allow_zero else '> 0'}, got {v!r}")
    return float(v)


def _mapping(where: str, key: str, v: Any, allowed=None) -> Mapping[str, Any]:
    """``v`` as a mapping whose keys are all in ``allowed`` (when given); errors name ``key``."""
    if not isinstance(v, Mapping):
        raise ConfigError(f"{where}: field {key!r} must be a mapping, got {type(v).__name__}")
    for k in v if allowed is not None else ():
        if k not in allowed:
            raise unknown_key_error(k, f"{where}: {key}", allowed, {})
    return v


def _gemm(where: str, raw: Any) -> dict[str, float]:
    raw = _mapping(where, "gemm_flops_per_s", raw, GEMM_DTYPES)
    out = {k: _positive(where, f"gemm_flops_per_s.{k}", v) for k, v in raw.items()}
    if "float32" not in out and "bfloat16" not in out:
        raise ConfigError(f"{where}: gemm_flops_per_s needs at least float32 or bfloat16")
    return out


def _gemm_rows(where: str, raw: Any) -> dict[str, dict[int, float]]:
    raw = _mapping(where, "gemm_rows_flops_per_s", raw, GEMM_DTYPES)
    out = {}
    for d, table in raw.items():
        table = _mapping(where, f"gemm_rows_flops_per_s.{d}", table)
        rows = {}
        for r, v in table.items():
            if isinstance(r, bool) or not isinstance(r, int) or r < 1:
                raise ConfigError(f"{where}: gemm_rows_flops_per_s.{d}: row count {r!r} must be an integer >= 1")
            rows[r] = _positive(where, f"gemm_rows_flops_per_s.{d}.{r}", v)
        out[d] = rows
    return out


def _collectives(where: str, raw: Any) -> dict[str, Collective]:
    raw = _mapping(where, "collectives", raw, COLLECTIVES)
    out = {}
    for k, v in raw.items():
        v = _mapping(where, f"collectives.{k}", v, ("alpha_s", "bytes_per_s"))
        if "alpha_s" not in v or "bytes_per_s" not in v:
            raise ConfigError(f"{where}: collectives.{k} needs alpha_s and bytes_per_s")
        out[k] = Collective(_positive(where, f"collectives.{k}.alpha_s", v["alpha_s"], allow_zero=True),
                            _positive(where, f"collectives.{k}.bytes_per_s", v["bytes_per_s"]))
    missing = [c for c in COLLECTIVES if c not in out]
    if missing:
        raise ConfigError(f"{where}: collectives is missing {', '.join(missing)}")
    return out


def _provenance(where: str, raw: Any, names: list[str]) -> dict[str, str]:
    raw = _mapping(where, "provenance", raw, names)
    out = {}
    for k, v in raw.items():
        kind = str(v).split(":", 1)[0].strip()
        if kind not in PROVENANCE_KINDS:
            raise ConfigError(f"{where}: provenance.{k} must start with one of "
                              f"{', '.join(p + ':' for p in PROVENANCE_KINDS)} (got {v!r})")
        out[k] = str(v)
    return out


def profile_from_dict(raw: Mapping[str, Any], where: str = "hardware profile") -> HardwareProfile:
    """Validate a profile mapping; ConfigError names ``where`` and the bad key."""
    names = [f.name for f in fields(HardwareProfile)]
    for k in raw:
        if k not in names:
            raise unknown_key_error(k, where, names, {})
    for k in _REQUIRED:
        if k not in raw:
            raise ConfigError(f"{where}: required field {k!r} is missing")
    kw: dict[str, Any] = {"name": str(raw["name"]), "source": str(raw["source"]),
                          "gemm_flops_per_s": _gemm(where, raw["gemm_flops_per_s"]),
                          "collectives": _collectives(where, raw["collectives"])}
    for k in ("memory_bytes_per_s", "attention_flops_per_s", "kv_read_bytes_per_s"):
        kw[k] = _positive(where, k, raw[k])
    for k in ("overlap_fraction", "op_overhead_s", "plan_block_s", "plan_request_s", "step_overhead_s",
              "memory_bytes", "ops_scale", "attention_call_s", "attention_scratch_bytes", "alloc_threshold_bytes",
              "alloc_bytes_per_s", "attention_merge_bytes_per_s", "attention_cache_bytes",
              "attention_spill_bytes_per_s", "collective_sync_s", "collective_wait_fraction", "link_bytes_per_s",
              "inter_node_bytes_per_s", "switch_kv_efficiency", "switch_weight_efficiency",
              "switch_handoff_s", "switch_contention"):
        if k in raw:
            kw[k] = _positive(where, k, raw[k], allow_zero=True)
    if "switch_blocking_factor" in raw:
        kw["switch_blocking_factor"] = _positive(where, "switch_blocking_factor", raw["switch_blocking_factor"])
    if kw.get("overlap_fraction", 0.0) > 1.0:
        raise ConfigError(f"{where}: field 'overlap_fraction' must be <= 1, got {kw['overlap_fraction']}")
    for k in ("switch_kv_efficiency", "switch_weight_efficiency"):
        if kw.get(k, 0.0) > 1.0:
            raise ConfigError(f"{where}: field {k!r} must be <= 1, got {kw[k]}")
        if kw.get(k, 0.0) > 0 and not kw.get("link_bytes_per_s"):
            raise ConfigError(f"{where}: field {k!r} needs link_bytes_per_s (the rate it is a share of)")
    for k, allowed in (("attention_combine", COMBINES), ("switch_kv_volume", KV_VOLUMES),
                       ("switch_overlap", OVERLAPS), ("switch_contention_on", CONTENTIONS)):
        if k in raw:
            if raw[k] not in allowed:
                raise ConfigError(f"{where}: field {k!r} = {raw[k]!r} is not one of {', '.join(allowed)}")
            kw[k] = raw[k]
    if "provenance" in raw:   # a field, or one number of `extra` as "extra.<key>"
        extra_keys = [f"extra.{k}" for k in (raw.get("extra") or {})]
        kw["provenance"] = _provenance(where, raw["provenance"], names + extra_keys)
    for k in ("moe_grouped", "attention_row_kernel", "fused_kernels"):
        if k in raw:
            if not isinstance(raw[k], bool):
                raise ConfigError(f"{where}: field {k!r} must be true or false, got {raw[k]!r}")
            kw[k] = raw[k]
    if "gemm_rows_flops_per_s" in raw:
        kw["gemm_rows_flops_per_s"] = _gemm_rows(where, raw["gemm_rows_flops_per_s"])
    for key, allow_zero in (("step_overhead_layout_s", True), ("prefill_attention_factor", False)):
        if key in raw:   # per layout
            v = _mapping(where, key, raw[key], LAYOUT_NAMES)
            kw[key] = {k: _positive(where, f"{key}.{k}", x, allow_zero) for k, x in v.items()}
    if "extra" in raw:
        kw["extra"] = dict(_mapping(where, "extra", raw["extra"]) or {})
    if "device_arch" in raw:
        if not re.fullmatch(r"(sm_\d+|gfx[0-9a-f]+)?", str(raw["device_arch"])):
            raise ConfigError(f"{where}: field 'device_arch' = {raw['device_arch']!r} is not a GPU arch name "
                              "(sm_<compute capability>, e.g. sm_90, or gfx<id>, e.g. gfx942; empty: unknown)")
        kw["device_arch"] = str(raw["device_arch"])
    return HardwareProfile(**kw)


# A GPU's name (torch.cuda.get_device_name) → the shipped profile of that part: splash-serve's profile when
# layout.hardware_profile is unset on a GPU, and gpu-check's HBM floor. Matched as a substring of the upper-cased name
# (NVIDIA names its SXM parts plainly: "NVIDIA H200", seen on one; an H200 NVL matches too, on its NVLink bridges;
# what a Hygon BW1000 reports has not been seen: a name without "BW1000" gets no profile).
DEVICE_PROFILES = (("B200", "b200"), ("H200", "h200"), ("BW1000", "bw1000"))


def profile_for_device(device_name: str) -> str | None:
    """The shipped profile of the GPU named `device_name`, or None when none is known for it."""
    up = device_name.upper()
    return next((p for key, p in DEVICE_PROFILES if key in up), None)


def hardware_dir() -> Path:
    env = os.environ.get("SPLASH_HARDWARE_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "configs" / "hardware"


def profile_names() -> list[str]:
    d = hardware_dir()
    return sorted(p.stem for p in d.glob("*.yaml")) if d.is_dir() else []


def load_profile(name_or_path: str) -> HardwareProfile:
    """A shipped profile by name ("cpu", "h200", "b200", "bw1000") or a YAML file by path."""
    p = Path(name_or_path)
    if p.suffix not in (".yaml", ".yml") and os.sep not in name_or_path:
        p = hardware_dir() / f"{name_or_path}.yaml"
        if not p.is_file():
            raise ConfigError(f"unknown hardware profile {name_or_path!r} (shipped: {', '.join(profile_names())}; "
                              f"or give a path to a profile YAML)")
    return profile_from_dict(read_yaml_mapping(p), str(p))


def save_profile(profile: HardwareProfile, path: str | Path, header: str = "") -> Path:
    import yaml

    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(profile.to_dict(), sort_keys=False)
    p.write_text((header.rstrip() + "\n" if header else "") + text)
    return p
