"""Which attention path a ROCm device can run, from its arch; checked at startup (exit 2 naming what to install).

    check_attention_arch("gfx936", "aiter")    # BackendUnavailable: Triton cannot compile for gfx936 …

AITER ships MLA decode kernels for gfx942 / gfx950 only (backends.hip.aiter_mla.DECODE_HEADS); on any other arch,
and for every shape AITER does not take, our Triton kernel runs — so the installed Triton must compile for the
device. Upstream Triton (PyPI) refuses Hygon's DCU archs (gfx928, gfx936: "unsupported target"); those need the
vendor's Triton build, and a ROCm torch brings its own (pytorch-triton-rocm) that a PyPI triton would overwrite.
Whether Triton can target an arch is asked of Triton itself: a one-line kernel compiled ahead of time for
GPUTarget("hip", arch, 64) in a child process (no GPU needed; ~2 s).
"""
from __future__ import annotations

import os
import subprocess
import sys

from backends.base import BackendUnavailable

HYGON_ARCHS = ("gfx928", "gfx936", "gfx938")
INSTALL = {"hygon": "the Triton build from Hygon's DTK for this DCU (its ROCm-compatible torch stack)",
           "amd": "the Triton that matches the ROCm build of torch (pytorch-triton-rocm from the PyTorch ROCm index)"}


def triton_target_error(arch: str, timeout: float = 120.0) -> str | None:
    """None when the installed Triton compiles a kernel for `arch`, else its error (last line)."""
    env = dict(os.environ, TRITON_INTERPRET="0")
    out = subprocess.run([sys.executable, "-m", "backends.hip.arch", "--probe", arch], env=env, text=True,
                         capture_output=True, timeout=timeout,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if out.returncode == 0:
        return None
    lines = [ln for ln in (out.stderr + out.stdout).splitlines() if "error" in ln.lower()] or \
        (out.stderr + out.stdout).splitlines()[-1:]
    return lines[0].strip() if lines else f"exit {out.returncode}"


def check_attention_arch(arch: str, attention: str) -> None:
    """BackendUnavailable when `attention` ('aiter' or 'triton') cannot run on `arch` with the installed Triton."""
    if attention not in ("aiter", "triton"):
        return
    err = triton_target_error(arch)
    if err is None:
        return
    from backends.hip.aiter_mla import DECODE_HEADS   # the archs AITER ships MLA decode kernels for
    who = "hygon" if arch in HYGON_ARCHS else "amd"
    path = ("AITER has no kernels for it, so our Triton kernel would run" if attention == "aiter" and
            arch not in DECODE_HEADS else "our Triton kernel runs every shape AITER does not take")
    raise BackendUnavailable(f"attention backend {attention!r} on a {arch} GPU: {path}, but the installed Triton "
                             f"cannot compile for {arch} ({err}); install {INSTALL[who]} — not triton from PyPI, "
                             "which would replace a ROCm torch's own")


def _probe(arch: str) -> int:
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def store_one(X):
        tl.store(X + tl.arange(0, 16), 1.0)

    triton.compile(ASTSource(store_one, {"X": "*fp32"}, {}), target=GPUTarget("hip", arch, 64))
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        sys.exit(_probe(sys.argv[2]))
    print(__doc__, file=sys.stderr)
    sys.exit(2)
