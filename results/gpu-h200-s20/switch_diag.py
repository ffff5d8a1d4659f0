"""device-tool diagnosis of gpu-check's live-switch row: the same scenario with one kernel in every layout."""
import sys, tempfile, threading, time
from pathlib import Path
sys.path.insert(0, "scripts")
from gpu_check_serve import LAYOUTS, _complete, _pin
from splash.bench.serve_proc import launch, stop

dry = "--dry-run" in sys.argv
base = (["--layout", "tp", "--max-num-seqs", "8", "--max-num-batched-tokens", "64"] +
        (["--backend", "cpu", "--preset", "tiny-mla", "--kv-cache-memory-bytes", "16MiB"] if dry else
         ["--backend", "cuda", "--preset", "gpu-smoke-mla", "--block-size", "64", "--kv-cache-memory-bytes", "1GiB"]))
variants = {"flashinfer+triton bf16 (gpu-check's)": ["--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16"],
            "triton only bf16": ["--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16", "--attention-backend", "triton"],
            "float32 (triton)": ["--dtype", "float32", "--kv-cache-dtype", "float32"]}
if dry:
    variants = {"float32": ["--dtype", "float32"]}
n = 24 if dry else 128
prompt = "The quick brown fox jumps over the lazy dog. " * 3
for name, extra in variants.items():
    log = Path(tempfile.mkdtemp()) / "serve.err"
    proc, url = launch(1, None, base + extra, "", log, timeout_s=300)
    try:
        want = _complete(url, prompt, n)
        results = []
        for trial in range(2):
            out = {}
            t = threading.Thread(target=lambda: out.setdefault("text", _complete(url, prompt, n)))
            t.start()
            for lay in LAYOUTS[1:] + ("tp",):
                time.sleep(0.05 * (trial + 1))
                _pin(url, lay)
            t.join()
            got = out["text"]
            i = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            results.append("same" if got == want else f"DIFFERS from char {i}/{len(want)}")
        print(f"{name}: switched runs vs unswitched: {results}", flush=True)
    finally:
        stop(proc)
    paths = sorted({l.strip()[-160:] for l in log.read_text().splitlines() if "attention" in l.lower()})
    for l in paths[:8]:
        print("   log:", l)
