"""scripts/gpu-check.sh on CPU: argument handling, the whole script in --dry-run (tiny shapes: the Triton kernel
under the interpreter and the communicator against the torch reference, the serve smoke with every layout and live
switches), and a wrong kernel turning its row into FAIL. The GPU checks themselves need a GPU (not run here)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402


def _sh(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_arguments():
    r = _sh("--ranks", "zero")
    assert r.returncode == 2 and "--ranks must be a positive integer" in r.stderr
    assert _sh("--help").stdout.startswith("One prepared check")
    if not torch.cuda.is_available():
        r = _sh()
        assert r.returncode == 2 and "no GPU visible to torch" in r.stderr and "--dry-run" in r.stderr
    with pytest.raises(SystemExit):
        gpu_check.parse(["--part", "kernels,bogus"])
    with pytest.raises(SystemExit):
        gpu_check.parse(["--batch", "0"])


def test_dry_run_passes_end_to_end():
    r = _sh("--dry-run")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for part in ("attention triton        PASS  decode via triton", "mixed via triton", "decode time torch",
                 "comm TorchCommunicator  PASS", "PASS  1 rank(s) on cpu", "serve tp ", "serve dop ",
                 "serve live switches  PASS", "== gpu-check: PASS"):
        assert part in out, out


def test_a_wrong_kernel_fails(monkeypatch, capsys):
    """A kernel whose LSE is off (e.g. a base-2 LSE left unconverted) gives a FAIL row and exit 1."""
    from splash.attention import kernels

    real = kernels.make_kernel

    class Base2(object):
        def __init__(self, k):
            self.k, self.paths = k, {"base2": 1}

        def plan(self, meta):
            self.k.plan(meta)

        def run(self, *a):
            o, lse = self.k.run(*a)
            return o, lse / 0.6931471805599453

    monkeypatch.setattr(kernels, "make_kernel", lambda n, s: Base2(real("torch", s)) if n == "base2" else real(n, s))
    monkeypatch.setattr(gpu_check, "kernel_names", lambda backend: ["base2"])
    monkeypatch.setattr(gpu_check, "time_decode", lambda *a: None)
    gpu_check.ROWS.clear()
    assert gpu_check.main(["--dry-run", "--part", "kernels"]) == 1
    out = capsys.readouterr().out
    assert "attention base2" in out and "FAIL" in out and "gpu-check: FAIL" in out
    gpu_check.ROWS.clear()
