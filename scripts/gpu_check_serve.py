"""gpu-check's serve smoke: splash-serve on this machine, every layout pinned, then live switches mid-request.

The same greedy completion must come back in every layout, and a long completion that runs while
POST /v1/layout switches through every layout must equal the one TP gave without switches — or, on a GPU whose
default kernel differs by layout (FlashInfer in TP / DP-attn / DOP, our Triton kernel in CP steps), first differ
at a near tie: each run's token among the other's top 5 there (bf16 rounding of two kernels, not lost state;
measured on an H200, docs/benchmarks.md "First GPU run"). On a GPU the same scenario then runs with
`--attention-backend triton`, one kernel in every layout, where the text must be identical.
"""
from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from splash.bench.serve_proc import launch, stop

LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def shares_gpus(backend, ranks: int) -> bool:
    """More ranks than GPUs (gpu-check --ranks N on a machine with fewer): some share one, where NCCL refuses to
    run, so their collectives go over MPI through host memory (`--communicator mpi`)."""
    if not backend.is_gpu:
        return False
    import torch
    return ranks > torch.cuda.device_count()


def _flags(args, backend) -> list[str]:
    flags = ["--layout", "tp", "--backend", backend.name, "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
    flags += ["--communicator", "mpi"] if shares_gpus(backend, args.ranks) else []
    return flags + (["--preset", "tiny-mla", "--dtype", "float32", "--kv-cache-memory-bytes", "16MiB"]
                    if args.dry_run else
                    ["--preset", "gpu-smoke-mla", "--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16",
                     "--block-size", "64", "--kv-cache-memory-bytes", "1GiB"])


TOP_K = 5   # logprobs asked of the long completions (the near-tie test's width, as vLLM's logprob comparisons)


def _completion(url: str, prompt: str, n: int, logprobs: int | None = None) -> dict:
    import httpx
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(f"{url}/v1/completions", timeout=300,
                   json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                         **({"logprobs": logprobs} if logprobs else {})})
    r.raise_for_status()
    return r.json()["choices"][0]


def _complete(url: str, prompt: str, n: int) -> str:
    return _completion(url, prompt, n)["text"]


def first_divergence(base: dict, got: dict) -> tuple[int | None, bool, str]:
    """(index of the first token where two greedy completions differ or None, whether that is a near tie, detail):
    a near tie when each run's token there is among the other's top-k logprobs (the two kernels' rounding chose
    between two almost equal logits; after it the texts may go apart). `base` / `got`: completions choices with
    `logprobs` (tokens, top_logprobs)."""
    a, b = base["logprobs"], got["logprobs"]
    i = next((k for k, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
    if i is None:
        return None, True, f"same {len(a['tokens'])} tokens"
    x, y, top_a, top_b = a["tokens"][i], b["tokens"][i], a["top_logprobs"][i], b["top_logprobs"][i]
    tie = y in top_a and x in top_b
    gap = f"{top_a[x] - top_a[y]:.3f}" if tie else "n/a"
    return i, tie, (f"first differs at token {i} of {len(a['tokens'])} ({x!r} vs {y!r}), "
                    f"{'a near tie: logprob gap ' + gap if tie else 'NOT a near tie'}")


def _pin(url: str, layout: str) -> None:
    import httpx
    r = httpx.post(f"{url}/v1/layout", json={"layout": layout}, timeout=120)
    r.raise_for_status()


PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def _pinned(url: str, row) -> None:
    want = _complete(url, PROMPT, 12)
    for lay in LAYOUTS:
        _pin(url, lay)
        got = _complete(url, PROMPT, 12)
        row(f"serve {lay}", f"pinned, greedy 12 tokens {'==' if got == want else '!='} tp's", got == want)


def _live(url: str, row, n_long: int, check: str, exact: bool) -> None:
    """A long greedy completion while POST /v1/layout walks every layout, against the same one in TP alone:
    identical, or (`exact` False) first different at a near tie."""
    import httpx
    _pin(url, "tp")
    base = _completion(url, PROMPT, n_long, TOP_K)
    out: dict[str, dict] = {}
    t = threading.Thread(target=lambda: out.setdefault("choice", _completion(url, PROMPT, n_long, TOP_K)))
    t.start()
    seen = []
    for lay in LAYOUTS[1:] + ("tp",):
        time.sleep(0.05)
        _pin(url, lay)
        seen.append(lay)
    t.join()
    switches = httpx.get(f"{url}/v1/layout", timeout=10).json().get("switch_count", 0)
    at, tie, detail = first_divergence(base, out["choice"])
    row(check, f"{n_long} tokens while switching {'->'.join(('tp',) + tuple(seen))} ({switches} switches so far) "
        f"vs without: {detail}", at is None or (tie and not exact))


def check_serve(args, backend, row) -> None:
    n_long = 24 if args.dry_run else 128
    if shares_gpus(backend, args.ranks):
        row("serve ranks share GPUs", f"{args.ranks} ranks: collectives over MPI through host memory "
            "(--communicator mpi; NCCL takes one rank per GPU)", None)
    _served(args, _flags(args, backend), row, lambda url: (
        _pinned(url, row), _live(url, row, n_long, "serve live switches", exact=args.dry_run)))
    if not args.dry_run:   # one kernel in every layout: switching itself must not change a single token
        _served(args, _flags(args, backend) + ["--attention-backend", "triton"], row,
                lambda url: _live(url, row, n_long, "serve live switches, triton in every layout", exact=True))


def _served(args, flags: list[str], row, scenario) -> None:
    proc = None
    try:
        proc, url = launch(args.ranks, None, flags, "", Path(tempfile.mkdtemp(prefix="gpu-check-")) / "serve.err",
                           timeout_s=300)
        scenario(url)
    except Exception as e:  # noqa: BLE001 — reported as a FAIL row with the server's last words
        row("serve", f"{type(e).__name__}: {str(e)[-600:]}", False)
    finally:
        if proc is not None:
            stop(proc)
