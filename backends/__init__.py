"""Device backends by name: ``cpu``, ``cuda`` (NVIDIA), ``hip`` (AMD ROCm / Hygon DCU) and ``auto``.

    backend = get_backend("auto", local_rank)   # a Backend: device, streams, memory, attention kernels

Imports are lazy: this module and ``backends.base`` import only the standard library, torch (inside functions)
and splash's ConfigError; the GPU
packages (flashinfer, aiter, triton) are imported by the attention kernel that needs them, never here, so a CPU
install never imports them. Asking for a backend the machine cannot run raises ``BackendUnavailable`` (a
``ConfigError``: splash-serve prints it and exits 2) naming the missing piece: the GPU, a CUDA/ROCm build of
torch, or the extra to install (``pip install 'splash[cuda]'`` / ``'splash[hip]'``).
"""
from __future__ import annotations

import importlib.util

from backends.base import Backend, BackendUnavailable, ranks_on_gpu

NAMES = ("cpu", "cuda", "hip", "auto")
# the attention kernels each backend can run, its default, and the Python packages each kernel needs
ATTENTION = {"cpu": ("torch", "triton"), "cuda": ("flashinfer", "triton", "torch"),
             "hip": ("aiter", "triton", "torch")}
KERNEL_PACKAGES = {"torch": (), "triton": ("triton",), "flashinfer": ("flashinfer", "triton"),
                   "aiter": ("aiter", "triton")}
INSTALL_HINT = {"triton": "pip install 'splash[cuda]' on NVIDIA; on ROCm the Triton of the ROCm torch build "
                          "(pytorch-triton-rocm) or, on a Hygon DCU, the DTK's — not triton from PyPI",
                "flashinfer": "pip install 'splash[cuda]': flashinfer-python",
                "aiter": "AITER is not on PyPI: build it from https://github.com/ROCm/aiter (see docs/backends.md)"}

__all__ = ["ATTENTION", "Backend", "BackendUnavailable", "NAMES", "attention_workspace_bytes", "detect",
           "get_backend", "missing_packages"]


def attention_workspace_bytes(kernel: str, launches=(), max_decode_rows: int = 0, arch: str = "",
                              dims: tuple[int, int] = (512, 64), page_size: int = 64) -> int:
    """Device bytes an attention kernel allocates for itself (the device budget counts them with the scratch),
    for the paths that can run: `launches` are what a rank's kernel is handed under each allowed layout
    (splash.layouts.layout.rank_attention: heads, KV dtype, CP or not), on an `arch` device ("sm_90",
    "gfx942"; "" unknown: any arch the kernel has paths for), for a model of `dims` (d_c, d_r) in pages of
    `page_size` tokens. Each vendor's own path choice decides (backends.cuda.flashinfer_mla.workspace_bytes,
    backends.hip.aiter_mla.workspace_bytes); a launch that runs our Triton kernel there costs nothing here
    (its temporaries are inside the step's scratch). trtllm-gen and AITER read the fused bf16 pool in place."""
    if kernel == "aiter":
        from backends.hip.aiter_mla import workspace_bytes
        return workspace_bytes(launches, max_decode_rows, arch, dims, page_size)
    if kernel == "flashinfer":
        from backends.cuda.flashinfer_mla import workspace_bytes
        return workspace_bytes(launches, arch, dims, page_size)
    return 0


def _torch_gpu() -> tuple[str | None, int]:
    """('cuda' | 'hip' | None, visible device count) of the installed torch build."""
    import torch
    vendor = "hip" if getattr(torch.version, "hip", None) else "cuda" if torch.version.cuda else None
    count = torch.cuda.device_count() if vendor and torch.cuda.is_available() else 0
    return vendor, count


def detect() -> str:
    """What `auto` means here: 'cuda' or 'hip' when torch sees a GPU of that vendor, else 'cpu'."""
    vendor, count = _torch_gpu()
    return vendor if vendor and count else "cpu"


def missing_packages(kernel: str) -> list[str]:
    """Packages `kernel` needs that are not installed (found without importing them)."""
    return [p for p in KERNEL_PACKAGES.get(kernel, ()) if importlib.util.find_spec(p) is None]


def _check_gpu(name: str) -> int:
    import torch
    vendor, count = _torch_gpu()
    label = {"cuda": "an NVIDIA GPU and a CUDA build of torch", "hip": "an AMD/Hygon GPU and a ROCm build of torch"}
    if vendor != name:
        build = "a CPU-only build" if vendor is None else f"a {'ROCm' if vendor == 'hip' else 'CUDA'} build"
        raise BackendUnavailable(f"backend {name!r} needs {label[name]}; this torch {torch.__version__} is {build} "
                                 f"(install the {'ROCm' if name == 'hip' else 'CUDA'} build of torch)")
    if count == 0:
        raise BackendUnavailable(f"backend {name!r} needs {label[name]}; torch {torch.__version__} is a "
                                 f"{'ROCm' if name == 'hip' else 'CUDA'} build but sees no GPU here "
                                 "(check the driver and CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)")
    return count


def get_backend(name: str, local_rank: int = 0, attention: str | None = None, local_size: int = 1) -> Backend:
    """The backend `name` for the rank with node-local index `local_rank` of `local_size` (its GPU is
    local_rank % GPUs; with more ranks than GPUs, ranks share one and each budgets its share of the memory).

    `attention` (a kernel name) is checked too: BackendUnavailable when the backend cannot run it or a package
    it needs is missing."""
    if name not in NAMES:
        raise BackendUnavailable(f"unknown backend {name!r} (choose from {', '.join(NAMES)})")
    if name == "auto":
        name = detect()
    if name == "cpu":
        backend = Backend("cpu", "cpu")
    else:
        count = _check_gpu(name)
        backend = Backend(name, f"cuda:{local_rank % count}", ranks_on_gpu(local_rank, local_size, count))
        import torch
        torch.cuda.set_device(backend.device)   # kernels that launch on "the current device" (Triton, AITER) too
    if attention is not None:
        check_attention(backend.name, attention, backend.device)
    return backend


def check_attention(backend: str, attention: str, device=None) -> None:
    """BackendUnavailable when `attention` cannot run on `backend` here: not one of its kernels, a package missing,
    or (hip, with the rank's `device`) a device arch the installed Triton cannot compile for."""
    if attention not in ATTENTION[backend]:
        raise BackendUnavailable(f"attention backend {attention!r} does not run on backend {backend!r} "
                                 f"(choose from {', '.join(ATTENTION[backend])})")
    missing = missing_packages(attention)
    if missing:
        hints = "; ".join(INSTALL_HINT.get(p, f"pip install {p}") for p in missing)
        raise BackendUnavailable(f"attention backend {attention!r} needs {', '.join(missing)}, which is not "
                                 f"installed ({hints})")
    if backend == "hip" and device is not None:   # AITER where it ships kernels, else Triton — if Triton can
        from backends.hip.aiter_mla import device_arch
        from backends.hip.arch import check_attention_arch
        check_attention_arch(device_arch(device), attention)
