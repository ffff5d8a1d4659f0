"""How far the Triton sparse MLA kernel (mla_sparse, under Triton's interpreter) is from dsa.sparse_attend, per KV
format: the worst max |ΔLSE| and max |Δõ| / max |õ| over mixed and decode-only steps, K = 5 / 21 / 37 selected
entries (duplicate slots, a row with none valid), 3 / 4 / 20 heads, two seeds; tiny dims (d_c 16, d_r 4).

    TRITON_INTERPRET=1 python benchmarks/triton_sparse_accuracy.py      # ~10 s on 2 cores; docs/benchmarks.md
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from test_attention_kernels import SCALE, SPARSE_DECODE, TINY, make_state, select_slots  # noqa: E402

from splash.attention.dsa import sparse_attend  # noqa: E402
from splash.attention.kernels.triton_mla import TritonMLAKernel  # noqa: E402
from splash.kv import quant  # noqa: E402


def worst(kv_dtype: str) -> tuple[float, float]:
    err_l = err_o = 0.0
    for specs in (TINY, SPARSE_DECODE):
        for K, heads in ((5, 3), (21, 4), (37, 20)):
            for seed in (0, 1):
                cache, _, _, _, meta, q = make_state(kv_dtype, 4, specs, dc=16, dr=4, heads=heads, seed=seed)
                sel = select_slots(meta, K, seed)
                k = TritonMLAKernel(SCALE)
                k.plan(meta)
                o, lse = k.run(0, q[..., :16], q[..., 16:], cache)
                o_ref, lse_ref = sparse_attend(q[..., :16], q[..., 16:], cache, 0, sel, SCALE)
                fin = lse_ref.isfinite()
                err_l = max(err_l, float((lse - lse_ref)[fin].abs().max()))
                err_o = max(err_o, float((o - o_ref).abs().max() / o_ref.abs().max()))
    return err_l, err_o


if __name__ == "__main__":
    for kv in quant.KV_DTYPES:
        print("%-9s max |dLSE| %.1e, max |do|/max|o| %.1e" % (kv, *worst(kv)))
