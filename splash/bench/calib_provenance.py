"""Where each number of a `splash-bench calibrate` profile comes from: its `provenance:` map (the kinds of
splash.costmodel.profile: spec / fitted / measured / assumed). Pure, no torch: the shipped cpu profile is checked
against it (tests/test_switch_cost.py).

Calibrate writes every HardwareProfile field (save_profile dumps them all); the ones it does not set keep the
dataclass default, which on a CPU models nothing (no link, no device memory, no switch primitives)."""
from __future__ import annotations

from collections.abc import Mapping

_ATTN_FIT = "fitted: the attention fit over isolated kernel calls and the attention inside real one-rank decode steps"
_PER_REQUEST = "assumed: 0, paged-attention metadata is built per request: its cost is in the op counts"

PROVENANCE = {
    "gemm_flops_per_s": "measured: 1,024-row GEMMs over the preset's weights as the engine holds them, per dtype",
    "gemm_rows_flops_per_s": "measured: float32 GEMMs at the row counts steps run (decode B rows, prefill chunks)",
    "memory_bytes_per_s": "measured: 4-row decode GEMMs streaming one rank's weight bytes",
    "alloc_bytes_per_s": "measured: writing a fresh temporary above the mmap threshold, beyond a reused one",
    "collectives": "fitted: alpha + bytes / beta to each collective timed over message sizes",
    "kv_read_bytes_per_s": _ATTN_FIT,
    "attention_flops_per_s": _ATTN_FIT,
    "attention_merge_bytes_per_s": _ATTN_FIT + " (1e15: the fit dropped the term)",
    "attention_spill_bytes_per_s": _ATTN_FIT + " (1e15: the fit dropped the term)",
    "attention_cache_bytes": "measured: the last-level cache size (sysfs) over the ranks",
    "attention_scratch_bytes": "spec: the torch kernel's split-KV chunk budget (torch_mla.SCRATCH_BYTES)",
    "alloc_threshold_bytes": "spec: glibc's largest dynamic mmap threshold on 64-bit, 32 MiB",
    "op_overhead_s": "fitted: a real one-rank B=1 decode step's residual per eager op, at least a trivial op's time",
    "attention_call_s": "assumed: 0, an attention call's host cost is in op_overhead_s's fit on a real step",
    "attention_row_kernel": "measured: whether SPLASH's C kernel runs every fp32 row on this host",
    "attention_combine": "assumed: sum, the torch kernel gathers each chunk of pages into a copy, then runs the bmm's",
    "overlap_fraction": "measured: 0, nonblocking MPI does not progress during compute here (docs/benchmarks.md, "
                        "switch overhead)",
    "plan_block_s": _PER_REQUEST,
    "plan_request_s": _PER_REQUEST,
    "step_overhead_s": "assumed: 0, a step's fixed cost is step_overhead_layout_s",
    "memory_bytes": "assumed: 0, device memory is not modelled on a CPU",
    "ops_scale": "assumed: 1, this engine's eager op counts",
    "moe_grouped": "assumed: false, per-expert op counts; grouped ones predicted the decode grids no better "
                   "(docs/benchmarks.md, cost model round 9)",
    "fused_kernels": "assumed: false, eager op counts; the fused path's predicted the decode grids no better "
                     "(docs/benchmarks.md, cost model round 9)",
    "step_overhead_layout_s": "fitted: a real 2-rank decode step (1 request a rank, 64 tokens) minus its prediction",
    "extra.world": "measured: the ranks calibrate ran on",
    "extra.tiny_op_s": "measured: a trivial eager op",
    "extra.attention_fit_call_s": "fitted: the attention fit's per-call term",
    "extra.attention_fit_median_rel_err": "fitted: the attention fit's median relative error",
    "extra.attention_fit_points": "measured: in-step points the attention refit kept",
    "extra.attention_fit_dropped": "measured: in-step points the attention refit dropped",
    "extra.attention_refit": "measured: why the attention refit was not used",
    "extra.in_step_collectives_timed": "measured: collective calls timed inside real steps (--in-step-collectives)",
}
# the numbers two options decide: (option off, option on)
BY_OPTION = {
    "collective_sync_s": ("in_step_collectives", (
        "fitted: least squares of real decode steps' residual on their collective count",
        "measured: a collective's own time inside real steps (--in-step-collectives)")),
    "collective_wait_fraction": ("in_step_collectives", (
        "assumed: 0, measured only with --in-step-collectives",
        "measured: the wait for the slower peer inside real steps (--in-step-collectives)")),
    "prefill_attention_factor": ("prefill_factors", (
        "assumed: none (1), measured only with --prefill-factors",
        "measured: the attention of a real 2-rank step carrying a 512-token chunk over its prediction "
        "(--prefill-factors)")),
}
DEFAULT = "assumed: the HardwareProfile default, not modelled on this hardware"
NOTE = "measured: a note of splash-bench calibrate"


def calibrated_provenance(profile: Mapping, in_step_collectives: bool = False,
                          prefill_factors: bool = False) -> dict[str, str]:
    """{key: provenance} for every number of a calibrated profile mapping (a profile's ``to_dict()`` or its YAML):
    every key but name, source and provenance, and each key of ``extra`` as ``extra.<key>``."""
    options = {"in_step_collectives": in_step_collectives, "prefill_factors": prefill_factors}
    keys = [k for k in profile if k not in ("name", "source", "provenance", "extra")]
    keys += [f"extra.{k}" for k in profile.get("extra") or {}]
    out = {}
    for k in keys:
        if k in BY_OPTION:
            option, (off, on) = BY_OPTION[k]
            out[k] = on if options[option] else off
        else:
            out[k] = PROVENANCE.get(k, NOTE if k.startswith("extra.") else DEFAULT)
    return out
