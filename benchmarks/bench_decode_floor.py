"""The GEMM floor of bench_decode_vs_hf's decode step: each GEMM the step runs, timed alone on this host.

    .venv/bin/python benchmarks/bench_decode_floor.py [--batch 32] [--context 64] [--threads 1] [--reps 60]

For the tiny DeepSeek-V3 of benchmarks/bench_decode_vs_hf.py (BENCH_MODEL) at `batch` decode rows over `context`
cached tokens, every GEMM of one SPLASH decode step (absorbed MLA projections and latent attention per layer,
dense MLP, shared + routed experts as one grouped call, LM head) is timed in isolation, twice: hot (its operands
stay in cache across repetitions) and cold (64 MB written before each call, so weights and KV come from DRAM, as
they do inside a step whose weights exceed the cache). Their per-step sums bound what any eager schedule of the
same GEMMs can reach: the step cannot be faster than its hot floor, and runs near the cold one when every weight
is read once per step. Routed-expert rows are spread evenly (batch × top-k over the experts).
"""
from __future__ import annotations

import argparse
import time

import torch

from bench_decode_vs_hf import BENCH_MODEL

FLUSH_BYTES = 64 << 20


def timed(fn, reps: int, flush: torch.Tensor | None) -> float:
    """Mean seconds of fn() over reps calls (after 3 warm-ups); with `flush`, written before each call."""
    for _ in range(3):
        fn()
    total = 0.0
    for _ in range(reps):
        if flush is not None:
            flush.add_(1.0)
        t0 = time.perf_counter()
        fn()
        total += time.perf_counter() - t0
    return total / reps


def step_gemms(m: dict, B: int, S: int) -> list[tuple[str, int, object]]:
    """(name, calls per step, fn) for every GEMM of one decode step of model `m` at B rows over S keys."""
    h, H, dc, dr = m["hidden_size"], m["num_attention_heads"], m["kv_lora_rank"], m["qk_rope_head_dim"]
    dn, dv, ql = m["qk_nope_head_dim"], m["v_head_dim"], m["q_lora_rank"]
    E, k, I, L = m["n_routed_experts"], m["num_experts_per_tok"], m["moe_intermediate_size"], m["num_hidden_layers"]
    moe_layers, dense_layers = L - m["first_k_dense_replace"], m["first_k_dense_replace"]
    r = torch.randn

    def lin(n_in: int, n_out: int, rows: int = B):
        x, w = r(rows, n_in), r(n_out, n_in)
        return lambda: x @ w.T

    def grouped(n_in: int, n_out: int):
        x, w = r(B * k, n_in), r(E, n_out, n_in)
        offs = torch.linspace(B * k / E, B * k, E).round().to(torch.int32)
        return lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)

    def bmm(b: int, m_: int, k_: int, n: int):
        x, y = r(b, m_, k_), r(b, k_, n)
        return lambda: torch.bmm(x, y)

    q_lat, q_pe, c, kpe = r(B, H, dc), r(B, H, dr), r(B, S, dc), r(B, S, dr)
    return [
        ("Q-A + KV-A", L, lin(h, ql + dc + dr)), ("Q-B", L, lin(ql, H * (dn + dr))),
        ("W_UK absorb (bmm)", L, bmm(H, B, dn, dc)),
        ("scores (bmm + baddbmm)", L, lambda: torch.baddbmm(torch.bmm(q_pe, kpe.transpose(1, 2)), q_lat,
                                                              c.transpose(1, 2))),
        ("values (bmm)", L, bmm(B, H, S, dc)), ("W_UV (bmm)", L, bmm(H, B, dc, dv)), ("O", L, lin(H * dv, h)),
        ("dense gate+up", dense_layers, lin(h, 2 * m["intermediate_size"])),
        ("dense down", dense_layers, lin(m["intermediate_size"], h)),
        ("shared gate+up", moe_layers, lin(h, 2 * I * m["n_shared_experts"])),
        ("shared down", moe_layers, lin(I * m["n_shared_experts"], h)),
        ("experts gate+up (grouped)", moe_layers, grouped(h, 2 * I)),
        ("experts down (grouped)", moe_layers, grouped(I, h)),
        ("LM head", 1, lin(h, m["vocab_size"])),
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=64, help="cached tokens per request (prompt 32 + 64 new: ~64)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=60)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from rich.console import Console
    from rich.table import Table

    flush = torch.empty(FLUSH_BYTES // 4)
    table = Table(title=f"decode-step GEMMs, batch {args.batch} x context {args.context}, {args.threads} thread(s)")
    for col in ("GEMM", "calls/step", "hot µs", "cold µs"):
        table.add_column(col, justify="left" if col == "GEMM" else "right")
    hot = cold = 0.0
    for name, calls, fn in step_gemms(BENCH_MODEL, args.batch, args.context):
        if calls == 0:
            continue
        h, c = timed(fn, args.reps, None), timed(fn, args.reps, flush)
        hot, cold = hot + calls * h, cold + calls * c
        table.add_row(name, str(calls), f"{h * 1e6:.0f}", f"{c * 1e6:.0f}")
    table.add_row("step floor (ms)", "", f"{hot * 1e3:.2f}", f"{cold * 1e3:.2f}", style="bold")
    Console(width=110).print(table)


if __name__ == "__main__":
    main()
