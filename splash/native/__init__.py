"""SPLASH's own CPU kernels (cpu_*.c with kernels.h: x86-64 AVX2 + FMA, fp32, one thread), built on first use with
the system C compiler ($CC or cc) into a library cached under $SPLASH_NATIVE_CACHE (default ~/.cache/splash/native)
by a hash of source and flags; concurrent builders each write a private file and rename it into place. `lib()` is
None, and every caller keeps its torch path, without AVX2/FMA, without a working compiler, or with SPLASH_NATIVE=0;
`enabled()` also wants one torch intra-op thread (with more, torch's GEMMs parallelise and win).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)
HERE = Path(__file__).parent
SOURCES = sorted(HERE.glob("cpu_*.c"))   # built together into one library, with kernels.h
FLAGS = ["-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-std=c99"]
_lib: ctypes.CDLL | None | bool = False   # False: not tried yet

P, I64, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SIGNATURES = {
    "grouped_gemm": (ctypes.c_int, [P, I64, ctypes.c_int, P, ctypes.c_int, P, ctypes.c_int, P]),
    "linear_packed": (None, [P, I64, ctypes.c_int, I64, P, ctypes.c_int, P]),
    "rms_norm": (None, [P, I64, ctypes.c_int, I64, P, F32, P]),
    "rope": (None, [P, I64, I64, I64, I64, ctypes.c_int, ctypes.c_int, P, P, P]),
    "swiglu": (None, [P, I64, ctypes.c_int, I64, P]),
    "mla_decode": (ctypes.c_int, [ctypes.c_int, P, I64, P, I64, P, P, P, P, I64, I64, ctypes.c_int, ctypes.c_int,
                                  ctypes.c_int, ctypes.c_int, P, P, I64, I64, P, P, F32, P, P]),
    "moe_route": (ctypes.c_int, [P, P, I64, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, F32,
                                 P, P]),
    "absorb_rope": (None, [P, I64, ctypes.c_int, I64, ctypes.c_int, ctypes.c_int, P, ctypes.c_int, ctypes.c_int,
                           ctypes.c_int, P, P, P]),
    "uv_heads": (None, [P, I64, ctypes.c_int, ctypes.c_int, P, ctypes.c_int, P]),
    "mla_project": (ctypes.c_int, [P, I64, ctypes.c_int, I64, ctypes.c_int, P, ctypes.c_int, P, P, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_int, P, ctypes.c_int, ctypes.c_int, P, F32, ctypes.c_int, P, P,
                                   P, P, P, P]),
    "mlp_packed": (ctypes.c_int, [P, I64, ctypes.c_int, I64, P, ctypes.c_int, P, ctypes.c_int, P]),
    "moe_experts": (ctypes.c_int, [P, I64, ctypes.c_int, P, I64, P, P, ctypes.c_int, P, ctypes.c_int, P, ctypes.c_int,
                                   P]),
    "moe_sort": (ctypes.c_int, [P, P, I64, ctypes.c_int, ctypes.c_int, P, P, P]),
}


def cpu_supported() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return False
    return {"avx2", "fma"} <= set(flags.split(":", 1)[-1].split())


def _build() -> Path:
    src = b"".join(p.read_bytes() for p in [*SOURCES, HERE / "kernels.h"])
    cc = os.environ.get("CC", "cc")
    tag = hashlib.sha256(src + " ".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("SPLASH_NATIVE_CACHE", Path.home() / ".cache" / "splash" / "native"))
    out = cache / f"splash_cpu_{tag}.so"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, f"-I{HERE}", *map(str, SOURCES), "-o", tmp, "-lm"], check=True,
                       capture_output=True, timeout=120)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def lib() -> ctypes.CDLL | None:
    global _lib
    if _lib is False:
        _lib = None
        if os.environ.get("SPLASH_NATIVE", "1") != "0" and cpu_supported():
            try:
                so = ctypes.CDLL(str(_build()))
                for name, (res, args) in SIGNATURES.items():
                    fn = getattr(so, name)
                    fn.restype, fn.argtypes = res, args
                _lib = so
            except (OSError, subprocess.SubprocessError) as e:
                detail = getattr(e, "stderr", b"") or b""
                log.warning("SPLASH's CPU kernels are unavailable (%s %s); using torch's", e,
                            detail.decode(errors="replace")[-500:])
    return _lib


def describe(threads: int | None = None) -> str:
    """Which CPU kernels run, for logs and --check, with the reason when it is torch's; `threads`: the intra-op
    threads to judge by (default: this process's)."""
    threads = torch.get_num_threads() if threads is None else threads
    if os.environ.get("SPLASH_NATIVE", "1") == "0":
        return "torch's (SPLASH_NATIVE=0)"
    if not cpu_supported():
        return "torch's (this CPU has no AVX2/FMA)"
    if lib() is None:
        return "torch's (SPLASH's did not build; see the warning above)"
    if threads != 1:
        return f"torch's ({threads} intra-op threads; SPLASH's run with 1)"
    return "SPLASH's (AVX2/FMA, 1 thread)"


def enabled() -> bool:
    return torch.get_num_threads() == 1 and (lib() if _lib is False else _lib) is not None


def fast_path(name: str):
    """Decorate a torch function with its kernel: `splash.native.ops.<name>` (same arguments) returns the kernel's
    result where it applies, else None and the torch function runs."""
    def wrap(torch_fn):
        @functools.wraps(torch_fn)
        def run(*args, **kw):
            out = getattr(_ops(), name)(*args, **kw)
            return torch_fn(*args, **kw) if out is None else out
        return run
    return wrap


@functools.cache
def _ops():
    return importlib.import_module("splash.native.ops")   # it imports packed, which imports this module
