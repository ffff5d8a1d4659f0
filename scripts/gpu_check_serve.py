"""gpu-check's serve smoke: splash-serve on this machine, every layout pinned, then live switches mid-request.

The same greedy completion must come back in every layout, and a long completion that runs while
POST /v1/layout switches through every layout must equal the one TP gave without switches.
"""
from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

from splash.bench.serve_proc import launch, stop

LAYOUTS = ("tp", "dp_attn", "cp", "dop")


def _flags(args, backend) -> list[str]:
    flags = ["--layout", "tp", "--backend", backend.name, "--max-num-seqs", "8", "--max-num-batched-tokens", "64"]
    return flags + (["--preset", "tiny-mla", "--dtype", "float32", "--kv-cache-memory-bytes", "16MiB"]
                    if args.dry_run else
                    ["--preset", "gpu-smoke-mla", "--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16",
                     "--block-size", "64", "--kv-cache-memory-bytes", "1GiB"])


def _complete(url: str, prompt: str, n: int) -> str:
    import httpx
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    r = httpx.post(f"{url}/v1/completions", timeout=300,
                   json={"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def _pin(url: str, layout: str) -> None:
    import httpx
    r = httpx.post(f"{url}/v1/layout", json={"layout": layout}, timeout=120)
    r.raise_for_status()


def _scenario(url: str, row, n_long: int) -> None:
    import httpx
    prompt = "The quick brown fox jumps over the lazy dog. " * 3
    want = _complete(url, prompt, 12)
    for lay in LAYOUTS:
        _pin(url, lay)
        got = _complete(url, prompt, 12)
        row(f"serve {lay}", f"pinned, greedy 12 tokens {'==' if got == want else '!='} tp's", got == want)
    _pin(url, "tp")
    base = _complete(url, prompt, n_long)
    out: dict[str, str] = {}
    t = threading.Thread(target=lambda: out.setdefault("text", _complete(url, prompt, n_long)))
    t.start()
    seen = []
    for lay in LAYOUTS[1:] + ("tp",):
        time.sleep(0.05)
        _pin(url, lay)
        seen.append(lay)
    t.join()
    switches = httpx.get(f"{url}/v1/layout", timeout=10).json().get("switch_count", 0)
    ok = out.get("text") == base
    row("serve live switches", f"{n_long} tokens while switching {'->'.join(('tp',) + tuple(seen))} "
        f"({switches} switches so far): {'same' if ok else 'DIFFERENT'} text as without", ok)


def check_serve(args, backend, row) -> None:
    proc = None
    try:
        proc, url = launch(args.ranks, None, _flags(args, backend), "",
                           Path(tempfile.mkdtemp(prefix="gpu-check-")) / "serve.err", timeout_s=300)
        _scenario(url, row, 24 if args.dry_run else 128)
    except Exception as e:  # noqa: BLE001 — reported as a FAIL row with the server's last words
        row("serve", f"{type(e).__name__}: {str(e)[-600:]}", False)
    finally:
        if proc is not None:
            stop(proc)
