"""KDA prefill: chunk-parallel gated delta rule (splash.models.kda.chunk_recurrence) vs token by token.

    .venv/bin/python benchmarks/bench_kda_prefill.py [--threads 1] [--prompt-len 512] [--repeats 3] [--chunk 16]

Two figures, each the best of `--repeats` runs of the token-by-token and the chunked form, interleaved:
- model: one 512-token prefill step (ModelRunner.step, one rank, fp32) of the tests' tiny GLM-5.3-Flash
  (tests/hf_glm5_next.py: 4 layers, 2 of them KDA with 8 heads of dim 8), written with `save_pretrained`;
  the chunked logits are checked against the token-by-token ones;
- recurrence: the recurrence alone on [prompt, H, d] inputs for the tiny model's heads (8 x 8) and for heads of
  GLM-5.3-Flash's width (d = 128, 4 heads: one TP-16 rank's share of 64).
Wall clock and process CPU time are printed (with one thread, CPU time is robust to other jobs on the cores).
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from hf_glm5_next import make_tiny_glm5_next  # noqa: E402
from test_kda_chunk import inputs  # noqa: E402

from splash.attention.batch import StepBatch, StepRequest  # noqa: E402
from splash.distributed.communicator import SingleRankCommunicator  # noqa: E402
from splash.engine.runner import ModelRunner  # noqa: E402
from splash.models import kda  # noqa: E402
from splash.models.loader import open_checkpoint  # noqa: E402


def timed(fn, repeats: int, chunks: dict[str, int]) -> dict[str, tuple[float, float, object]]:
    """{name: (best wall s, best CPU s, last result)} running fn once per chunk setting, interleaved."""
    best: dict[str, list] = {k: [float("inf"), float("inf"), None] for k in chunks}
    for _ in range(repeats):
        for name, c in chunks.items():
            kda.CHUNK = c
            w, p = time.perf_counter(), time.process_time()
            out = fn()
            b = best[name]
            b[0], b[1], b[2] = min(b[0], time.perf_counter() - w), min(b[1], time.process_time() - p), out
    return {k: tuple(v) for k, v in best.items()}


def report(what: str, res: dict) -> None:
    (tw, tc, _), (cw, cc, _) = res["token"], res["chunked"]
    print(f"{what:42s} token {tw * 1e3:8.1f} ms wall {tc * 1e3:8.1f} ms cpu | chunked {cw * 1e3:8.1f} ms wall "
          f"{cc * 1e3:8.1f} ms cpu | speedup {tw / cw:5.2f}x wall {tc / cc:5.2f}x cpu")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=kda.CHUNK)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    chunks = {"token": 1, "chunked": a.chunk}
    n = a.prompt_len
    with tempfile.TemporaryDirectory() as tmp:
        cfg, get = open_checkpoint(make_tiny_glm5_next(Path(tmp) / "m", index_topk=8))
        runner = ModelRunner(cfg, get, SingleRankCommunicator(), "tp", "float32", 16, -(-n // 16) + 4)
        prompt = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(0))

        def prefill():
            runner.release("a")
            return runner.step(StepBatch([StepRequest("a", 0, n)], prompt, torch.arange(n), [n - 1]))
        res = timed(prefill, a.repeats, chunks)
        err = float((res["chunked"][2] - res["token"][2]).abs().max() / res["token"][2].abs().max())
        report(f"model prefill {n} tokens (tiny glm5_next)", res)
        print(f"  logits max rel diff chunked vs token: {err:.2e}")
    for H, d in ((8, 8), (4, 128)):
        x = inputs(n, H, d, "lower_bound")
        report(f"recurrence {n} x {H} heads x d {d}", timed(lambda: kda._recurrence(*x) if kda.CHUNK == 1
                                                             else kda.chunk_recurrence(*x, kda.CHUNK),
                                                             a.repeats, chunks))
    print(f"threads {a.threads}, chunk {a.chunk}, torch {torch.__version__}")


if __name__ == "__main__":
    main()
