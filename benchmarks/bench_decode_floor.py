"""The GEMM floor of bench_decode_vs_hf's decode step: each GEMM the step runs, timed alone on this host.

    .venv/bin/python benchmarks/bench_decode_floor.py [--batch 32] [--context 64] [--threads 1] [--reps 60]

For the tiny DeepSeek-V3 of benchmarks/bench_decode_vs_hf.py (BENCH_MODEL) at `batch` decode rows over `context`
cached tokens, every GEMM of one SPLASH decode step (absorbed MLA projections and latent attention per layer,
dense MLP, shared + routed experts as one grouped call, LM head) is timed in isolation, twice: hot (its operands
stay in cache across repetitions) and cold (64 MB written before each call, so weights and KV come from DRAM, as
they do inside a step whose weights exceed the cache). Their per-step sums bound what any eager schedule of the
same GEMMs can reach: the step cannot be faster than its hot floor, and runs near the cold one when every weight
is read once per step. Routed-expert rows are spread evenly (batch × top-k over the experts).

Two more columns time each line as SPLASH runs it where its own CPU kernels (splash.native) apply: packed GEMMs
for the dense MLP, the shared and routed experts and the LM head, and `mla_decode` for the attention over a paged
pool (page size 16, pages shuffled; it includes the softmax, which the torch line's two GEMMs leave out). Lines the
engine leaves to torch (the attention projections, rewritten by layout switches) repeat the torch time.
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


def _native_linear(x: torch.Tensor, w: torch.Tensor):
    from splash.native.packed import pack_linear
    p = pack_linear(w)
    return (lambda: p(x)) if p is not w else None


def _native_grouped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor):
    from splash.models.linear import grouped_packed
    from splash.native.packed import pack_experts
    p = pack_experts(w)
    return (lambda: grouped_packed(x, p, counts)) if p is not w else None


def _native_attention(B: int, S: int, H: int, dc: int, dr: int, bs: int = 16):
    """mla_decode for B rows over S keys each in a paged fp32 pool (pages shuffled), or None without the kernels."""
    from splash import native
    from splash.native import ops  # noqa: F401  registers torch.ops.splash
    if not native.enabled():
        return None
    r, n = torch.randn, -(-S // bs)
    ckv, kpe = r(B * n, bs, dc), r(B * n, bs, dr)
    pages = torch.randperm(B * n, generator=torch.Generator().manual_seed(0)).to(torch.int32).view(B, n).contiguous()
    logical = torch.arange(n, dtype=torch.int32).repeat(B, 1).contiguous()
    rows, npg, qpos = torch.arange(B), torch.full((B,), n, dtype=torch.int32), torch.full((B,), S - 1)
    q = r(B, H, dc + dr)   # q̃ = [latent ; rope], as the engine's

    def run():
        torch.ops.splash.mla_decode(rows, rows, npg, qpos, pages, logical, q[..., :dc], q[..., dc:], ckv, kpe, 0.1)
    return run


def step_gemms(m: dict, B: int, S: int) -> list[tuple[str, int, object, object]]:
    """(name, calls per step, fn, SPLASH's fn or None) for every GEMM of one decode step of model `m` at B rows
    over S keys; the last is what the engine runs instead where splash.native applies (None: the same as fn)."""
    h, H, dc, dr = m["hidden_size"], m["num_attention_heads"], m["kv_lora_rank"], m["qk_rope_head_dim"]
    dn, dv, ql = m["qk_nope_head_dim"], m["v_head_dim"], m["q_lora_rank"]
    E, k, I, L = m["n_routed_experts"], m["num_experts_per_tok"], m["moe_intermediate_size"], m["num_hidden_layers"]
    moe_layers, dense_layers = L - m["first_k_dense_replace"], m["first_k_dense_replace"]
    r = torch.randn

    def lin(n_in: int, n_out: int, rows: int = B, packed: bool = False):
        x, w = r(rows, n_in), r(n_out, n_in)
        return (lambda: x @ w.T), (_native_linear(x, w.clone()) if packed else None)

    def grouped(n_in: int, n_out: int):
        x, w = r(B * k, n_in), r(E, n_out, n_in)
        offs = torch.linspace(B * k / E, B * k, E).round().to(torch.int32)
        counts = torch.diff(offs.long(), prepend=torch.zeros(1, dtype=torch.long))
        return (lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)), _native_grouped(x, w.clone(), counts)

    def bmm(b: int, m_: int, k_: int, n: int):
        x, y = r(b, m_, k_), r(b, k_, n)
        return (lambda: torch.bmm(x, y)), None

    q_lat, q_pe, c, kpe = r(B, H, dc), r(B, H, dr), r(B, S, dc), r(B, S, dr)
    pv = r(B, H, S)

    def attention():
        torch.baddbmm(torch.bmm(q_pe, kpe.transpose(1, 2)), q_lat, c.transpose(1, 2))
        torch.bmm(pv, c)

    return [
        ("Q-A + KV-A", L, *lin(h, ql + dc + dr)), ("Q-B", L, *lin(ql, H * (dn + dr))),
        ("W_UK absorb (bmm)", L, *bmm(H, B, dn, dc)),
        ("attention: scores + values (torch: the 2 GEMMs; SPLASH: mla_decode)", L, attention,
         _native_attention(B, S, H, dc, dr)),
        ("W_UV (bmm)", L, *bmm(H, B, dc, dv)), ("O", L, *lin(H * dv, h)),
        ("dense gate+up", dense_layers, *lin(h, 2 * m["intermediate_size"], packed=True)),
        ("dense down", dense_layers, *lin(m["intermediate_size"], h, packed=True)),
        ("shared gate+up", moe_layers, *lin(h, 2 * I * m["n_shared_experts"], packed=True)),
        ("shared down", moe_layers, *lin(I * m["n_shared_experts"], h, packed=True)),
        ("experts gate+up (grouped)", moe_layers, *grouped(h, 2 * I)),
        ("experts down (grouped)", moe_layers, *grouped(I, h)),
        ("LM head", 1, *lin(h, m["vocab_size"], packed=True)),
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
    for col in ("GEMM", "calls/step", "torch hot µs", "torch cold µs", "SPLASH hot µs", "SPLASH cold µs"):
        table.add_column(col, justify="left" if col == "GEMM" else "right")
    sums = [0.0] * 4
    for name, calls, fn, ours in step_gemms(BENCH_MODEL, args.batch, args.context):
        if calls == 0:
            continue
        t = [timed(fn, args.reps, None), timed(fn, args.reps, flush)]
        t += [timed(ours, args.reps, None), timed(ours, args.reps, flush)] if ours is not None else t
        sums = [s + calls * x for s, x in zip(sums, t)]
        table.add_row(name, str(calls), *(f"{x * 1e6:.0f}" + ("" if ours is not None or i < 2 else " (torch)")
                                          for i, x in enumerate(t)))
    table.add_row("step floor (ms)", "", *(f"{s * 1e3:.2f}" for s in sums), style="bold")
    Console(width=110).print(table)


if __name__ == "__main__":
    main()
