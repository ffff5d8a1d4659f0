"""Worker for test_quant_dist: FP8 / INT8 weights on real ranks, in every layout and through every switch.

argv: (ref.pt mode runs) repeated: one job per three arguments, run in turn in one launch   (runs: comma-separated;
  "layouts": schemes, "switch": scheme:live|blocking)
  mode "layouts": the quantised checkpoint of each scheme in each of the four layouts gives transformers'
      greedy tokens on the dequantised checkpoint; every rank's resident weight bytes equal the memory model.
  mode "switch": one run whose layout walks all 12 directions (tp→dp_attn→tp→cp→tp→dop→dp_attn→cp→
      dp_attn→dop→cp→dop→tp; a switch at every step from step 1), live or blocking; tokens unchanged; after
      every switch each rank's projections equal, bit for bit, a fresh load of the checkpoint in the current
      layout (all-gathers reassemble the stored values and scales); resident weight bytes equal the memory
      model before, between and after the switches (no hidden copy); the bytes each all-gather delivers equal
      the manifest's weight_recv_bytes. Scheme "plain" runs the same on the fp32 checkpoint (a switch
      must not leave [Q-A ; KV-A] and its views both alive). Hybrid (glm5_next) schemes: the same checks,
      KDA projections included (resident bytes and the manifest's weight bytes count KDA and MLA layers each
      as stored).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

from switch_worker import drive

from splash.engine.llm import LLM
from splash.layouts.memory import rank_weight_bytes
from splash.models.build import build_weights
from splash.models.glm5_next import build_hybrid_weights
from splash.models.loader import open_checkpoint
from splash.native.packed import PackedLinear
from splash.models.qweight import QuantWeight, RowStack
from splash.models.weights import resident_bytes

LAYOUTS = ("tp", "dp_attn", "cp", "dop")
CIRCUIT = ["dp_attn", "tp", "cp", "tp", "dop", "dp_attn", "cp", "dp_attn", "dop", "cp", "dop", "tp"]


def make(model_dir, layout, mode="live") -> LLM:
    return LLM(str(model_dir), layout=layout, block_size=4, max_num_batched_tokens=16, num_kv_blocks=256,
               switch_mode=mode)


KDA_FIELDS = ("qkv", "conv", "f_a", "f_b", "dt_bias", "a_log", "b", "g_a", "g_b", "o_norm", "o")
MLA_FIELDS = ("q_b", "kv_b", "o", "w_uk", "w_uv", "q_a", "kv_a")


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is b
    if isinstance(a, RowStack):
        return isinstance(b, RowStack) and len(a.parts) == len(b.parts) and all(map(_same, a.parts, b.parts))
    if isinstance(a, PackedLinear):   # fp32 projections packed for SPLASH's CPU GEMM
        return isinstance(b, PackedLinear) and a.shape == b.shape and torch.equal(a.packed, b.packed)
    if isinstance(a, QuantWeight):
        return (isinstance(b, QuantWeight) and (a.fmt, a.row_off, a.col_off) == (b.fmt, b.row_off, b.col_off)
                and a.data.shape == b.data.shape and torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8))
                and torch.equal(a.scale, b.scale))
    return isinstance(b, torch.Tensor) and torch.equal(a, b)


def check_weights(llm: LLM, model_dir, what: str) -> None:
    """Projections equal a fresh load in the current layout bit for bit; resident weight bytes equal the memory
    model (hybrid models: KDA heads included)."""
    r = llm.runner
    cfg, get = open_checkpoint(model_dir, r.dtype)
    hybrid = cfg.hybrid is not None
    st = r.layout_state
    fresh = (build_hybrid_weights(cfg, get, st.heads, st.linear_heads, r.comm.rank, r.comm.size) if hybrid
             else build_weights(cfg, get, st.heads, r.comm.rank, r.comm.size))
    for i, (a, b) in enumerate(zip(r.weights.layers, fresh.layers)):
        linear = hybrid and cfg.is_linear_layer(i)
        for name in KDA_FIELDS if linear else MLA_FIELDS:
            assert _same(getattr(a.attn, name), getattr(b.attn, name)), f"{what}: layer {i} {name} differs"
        assert a.attn.heads == (st.linear_heads if linear else st.heads), (what, i, a.attn.heads)
    want = rank_weight_bytes(cfg, r.layout, r.comm.size, r.comm.rank, r.dtype.itemsize, r.weight_quant)
    got = resident_bytes(r.weights)
    assert got == want, f"{what}: rank {r.comm.rank} holds {got} weight bytes, expected {want}"


def layouts(ref, scheme, rank_print) -> None:
    qdir = ref["dirs"][scheme][0]
    for layout in LAYOUTS:
        llm = make(qdir, layout)
        check_weights(llm, qdir, f"{scheme} {layout}")
        got = drive(llm, ref["prompts"], ref["max_tokens"], {})
        if got is not None:
            assert got == ref["tokens"][scheme], f"{scheme} {layout}: {got} != {ref['tokens'][scheme]}"
        rank_print(f"layouts {scheme} {layout} OK")


def instrument(llm: LLM, model_dir, log: list) -> None:
    """After every step: weights equal a fresh load in the current layout and resident bytes the memory model.
    Every projection all-gather: the bytes it delivered from the other ranks (checked against the manifest)."""
    r = llm.runner
    step, gather = r.step, r.comm.iall_gatherv
    received = [0]

    def wrapped_gather(t, counts=None):
        h = gather(t, counts)
        wait = h.wait

        def waited():
            out = wait()
            received[0] += (out.numel() - t.numel()) * out.element_size()
            return out
        h.wait = waited
        return h

    def wrapped_step(batch, switch=None):
        # counted from the last switch's check: a blocking switch gathers as the engine begins it, before the step
        src = switch.m.src.value if switch is not None else r.layout   # the engine adopts before the step
        logits = step(batch, switch)
        if switch is not None:
            want = switch.m.weight_recv_total[r.comm.rank]
            assert received[0] == want, \
                f"{src}->{r.layout}: received {received[0]} weight bytes, manifest {want}"
            received[0] = 0
            log.append(f"{src}->{r.layout}")
            check_weights(llm, model_dir, f"after {src}->{r.layout}")
        return logits

    r.comm.iall_gatherv, r.step = wrapped_gather, wrapped_step


def switch(ref, scheme, mode, rank_print) -> None:
    qdir = ref["dirs"][scheme][0]
    llm = make(qdir, "tp", mode)
    check_weights(llm, qdir, f"{scheme} before")
    log: list[str] = []
    instrument(llm, qdir, log)
    got = drive(llm, ref["prompts"], ref["max_tokens"], {1 + i: d for i, d in enumerate(CIRCUIT)})
    path = ["tp"] + CIRCUIT
    want = [f"{a}->{b}" for a, b in zip(path, path[1:])]
    assert log == want, f"{scheme} {mode}: switches {log} != {want}"
    if got is not None:
        assert got == ref["tokens"][scheme], f"{scheme} {mode}: {got} != {ref['tokens'][scheme]}"
    rank_print(f"switch {scheme} {mode} OK ({len(log)} directions)")


def main() -> None:
    args = sys.argv[1:]
    assert len(args) % 3 == 0, f"argv: (ref.pt mode runs) repeated, got {args}"
    import splash.distributed as dist
    rank = dist.init_dist().rank

    def rank_print(msg: str) -> None:
        print(f"rank {rank}: {msg}", flush=True)

    for i in range(0, len(args), 3):   # several checkpoints and modes share one launch: rank start-up once
        ref_path, mode, runs = args[i:i + 3]
        ref = torch.load(ref_path)
        for run in runs.split(","):
            if mode == "layouts":
                layouts(ref, run, rank_print)
            else:
                scheme, how = run.split(":")
                switch(ref, scheme, how, rank_print)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from mpi_util import run_worker

    run_worker(main)
