"""scripts/gpu-check.sh on CPU: argument handling, the whole script in --dry-run (tiny shapes: the Triton kernel
under the interpreter and the communicator against the torch reference, the serve smoke with every layout and live
switches), and a wrong kernel turning its row into FAIL. The GPU checks themselves need a GPU (not run here)."""
from __future__ import annotations

import json
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


def _sh(*args: str, timeout: float = 400, env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
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


def test_dry_run_passes_end_to_end(tmp_path):
    """Every row the GPU run has, on CPU: 16/64/128 heads, bf16 and fp8 KV, decode and mixed steps over requests
    with odd page counts (the Triton kernel under the interpreter), the decode timing, the communicator, the serve
    smoke; one rank says what it skipped; the table and the JSON file at the end."""
    out_json = tmp_path / "rows.json"
    r = _sh("--dry-run", env={"GPU_CHECK_JSON": str(out_json)})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    for heads in (16, 64, 128):
        for kv in gpu_check.KV_DTYPES:
            for step in ("decode", "mixed"):
                assert f"attention triton {kv} H={heads} {step}" in out, out
    for kv in gpu_check.KV_DTYPES:
        for step in ("decode", "mixed"):
            assert f"attention torch {kv} H=64 sparse {step}" in out and f"attention triton {kv} H=64 sparse {step}" \
                in out, out
    for part in ("decode time torch", "comm collectives", "comm across ranks", "serve tp ", "serve dop ",
                 "serve live switches", "== gpu-check: PASS"):
        assert part in out, out
    rows = {r["check"]: r["result"] for r in json.loads(out_json.read_text())}
    assert rows["comm across ranks"] == rows["serve layouts across ranks"] == "SKIP"
    assert rows["serve live switches"] == rows["attention triton fp8_e4m3 H=128 decode"] == "PASS"
    table = r.stdout[r.stdout.rindex("== gpu-check results"):]                      # the table comes last
    assert "serve live switches" in table and "attention triton bfloat16 H=16 decode" in table
    assert "gpu-check: PASS (36 PASS, 0 FAIL, 2 SKIP, 1 info)" in table


def test_rows_print_as_they_run_and_a_failing_check_is_one_row(monkeypatch, capsys):
    """An exception inside a check (a missing compiler for a JIT, an OOM) becomes that check's FAIL row, printed at
    once; the later checks still run and the table still comes."""
    def boom(args, backend):
        print("comm starting", flush=True)
        raise RuntimeError("no nvcc for the JIT")

    monkeypatch.setattr(gpu_check, "kernel_names", lambda backend: [])
    monkeypatch.setattr(gpu_check, "check_comm", boom)
    gpu_check.ROWS.clear()
    assert gpu_check.main(["--dry-run", "--part", "kernels,comm"]) == 1
    out = capsys.readouterr().out
    assert out.index("decode time torch") < out.index("comm starting")     # printed before the next check ran
    assert "comm collectives" in out and "FAIL  RuntimeError: no nvcc for the JIT" in out
    assert out.index("no nvcc") < out.index("comm across ranks") < out.index("== gpu-check results")
    gpu_check.ROWS.clear()


def test_backend_comes_from_the_launchers_local_rank(monkeypatch):
    """The node-local rank and count are the project's launcher's (MPI's shared-memory split, for every MPI), not an
    Open MPI environment variable; the count says how many ranks share a GPU."""
    import types

    import backends
    import splash.distributed as dist
    seen = []
    monkeypatch.setattr(dist, "init_dist", lambda: types.SimpleNamespace(local_rank=3, local_size=4))
    monkeypatch.setattr(backends, "get_backend", lambda name, local_rank, local_size: seen.append(
        (name, local_rank, local_size)))
    monkeypatch.delenv("OMPI_COMM_WORLD_LOCAL_RANK", raising=False)
    gpu_check.backend_of(gpu_check.parse(["--device", "cuda"]))
    assert seen == [("cuda", 3, 4)]


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
    assert "attention base2 bfloat16 H=16 decode" in out and "FAIL" in out and "gpu-check: FAIL" in out
    gpu_check.ROWS.clear()


GPU_CHECK_NEEDS = ("torch", "mpi4py", "mpich", "httpx", "triton", "flashinfer-python")   # + nvcc: README


@pytest.mark.timeout(300)
def test_gpu_install_line_brings_what_gpu_check_needs(tmp_path):
    """The README's GPU install line, resolved by pip (--dry-run: nothing installed): walking the requirements from
    splash[cuda,gpu-check] through what pip would install and what is installed here reaches everything
    gpu-check imports or runs; torch (the CUDA build, installed first) is not replaced."""
    from importlib.metadata import PackageNotFoundError, distribution

    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
    line = "pip install -e '.[cuda,gpu-check]'"
    assert line in (ROOT / "README.md").read_text()
    report = tmp_path / "report.json"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "-q", "--report", str(report),
                        f"{ROOT}[cuda,gpu-check]"], capture_output=True, text=True, timeout=280)
    if r.returncode != 0 and any(w in r.stderr for w in ("Connection", "Max retries", "Temporary failure")):
        pytest.skip(f"no package index reachable: {r.stderr[-300:]}")
    assert r.returncode == 0, r.stderr[-2000:]
    new = {canonicalize_name(i["metadata"]["name"]): i["metadata"].get("requires_dist", [])
           for i in json.loads(report.read_text())["install"]}
    assert "torch" not in new and "splash" in new

    def requires(name: str, extras: tuple = ()) -> list[str]:
        if name in new:
            reqs = new[name]
        else:
            try:
                reqs = distribution(name).requires or []
            except PackageNotFoundError:
                return []
        out = []
        for spec in map(Requirement, reqs):
            envs = [dict(default_environment(), extra=e) for e in extras or ("",)]
            if spec.marker is None or any(spec.marker.evaluate(env) for env in envs):
                out.append(canonicalize_name(spec.name))
        return out

    seen, todo = set(), requires("splash", ("cuda", "gpu-check"))
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += requires(name)
    missing = [n for n in GPU_CHECK_NEEDS if canonicalize_name(n) not in seen]
    assert not missing, f"{line} does not bring {missing}"


def test_two_ranks_run_the_collectives_and_print_per_rank_rows(tmp_path):
    """At two ranks (mpirun -n 2, as on a 2-GPU box) the communicator row runs across ranks instead of a SKIP, and
    rank 0's table holds every rank's rows."""
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip("no mpiexec next to this python")
    out_json = tmp_path / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    r = subprocess.run([str(mpiexec), "-n", "2", sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run",
                        "--part", "comm", "--json", str(out_json)], cwd=ROOT, capture_output=True, text=True,
                       timeout=240, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = {row["check"]: row["result"] for row in json.loads(out_json.read_text())}
    assert rows == {"[rank 0] comm collectives": "PASS", "[rank 1] comm collectives": "PASS"}
    assert "[rank 1] comm collectives" in r.stdout and "2 rank(s) on cpu" in r.stdout


def test_a_switched_completion_may_first_differ_only_at_a_near_tie():
    """gpu-check's live-switch row on a GPU whose kernel differs by layout: the runs may part only where each run's
    token is among the other's top logprobs; a token outside them (lost or wrong state) fails, as does any
    difference where one kernel serves every layout (exact)."""
    from gpu_check_serve import first_divergence

    def choice(tokens, tops):
        return {"logprobs": {"tokens": tokens, "top_logprobs": tops}}
    base = choice(["a", "b", "c"], [{"a": -0.1}, {"b": -0.70, "x": -0.71}, {"c": -0.2}])
    assert first_divergence(base, base) == (None, True, "same 3 tokens")
    near = choice(["a", "x", "q"], [{"a": -0.1}, {"x": -0.69, "b": -0.72}, {"q": -0.3}])
    at, tie, detail = first_divergence(base, near)
    assert (at, tie) == (1, True) and "near tie: logprob gap 0.010" in detail
    far = choice(["a", "z", "c"], [{"a": -0.1}, {"z": -0.1, "b": -5.0}, {"c": -0.2}])
    at, tie, detail = first_divergence(base, far)
    assert (at, tie) == (1, False) and "NOT a near tie" in detail


def test_ranks_beyond_the_gpus_share_them_over_mpi(monkeypatch):
    """`--ranks 2` on a one-GPU machine: NCCL refuses two ranks on one GPU, so the server gets
    `--communicator mpi` (GPU tensors through host memory) and the comm row checks that communicator."""
    from types import SimpleNamespace

    from gpu_check_serve import _flags, shares_gpus
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    gpu, cpu = SimpleNamespace(is_gpu=True, name="cuda"), SimpleNamespace(is_gpu=False, name="cpu")
    assert shares_gpus(gpu, 2) and not shares_gpus(gpu, 1) and not shares_gpus(cpu, 4)
    flags = lambda backend, ranks: _flags(SimpleNamespace(ranks=ranks, dry_run=False), backend)  # noqa: E731
    assert flags(gpu, 2)[flags(gpu, 2).index("--communicator") + 1] == "mpi"
    assert "--communicator" not in flags(gpu, 1)


def test_a_kernel_that_ignores_the_dsa_selection_fails_the_sparse_rows(monkeypatch, capsys):
    """The sparse rows compare every kernel with fp32 attention over exactly the selected keys: one that attends
    every key it sees (the selection dropped) passes the dense rows and fails the sparse ones."""
    import dataclasses

    from splash.attention import kernels

    real = kernels.make_kernel

    class Dense:
        def __init__(self, k):   # it claims the Triton sparse kernel ran: only its numbers can fail the rows
            self.k, self.paths, self.launches = k, {"triton": 1}, {"mla_sparse": 1}

        def plan(self, meta):
            self.k.plan(dataclasses.replace(meta, sparse={}))

        def run(self, *a):
            return self.k.run(*a)

    monkeypatch.setattr(kernels, "make_kernel", lambda n, s: Dense(real("torch", s)) if n == "dense" else real(n, s))
    monkeypatch.setattr(gpu_check, "kernel_names", lambda backend: ["dense"])
    monkeypatch.setattr(gpu_check, "time_decode", lambda *a: None)
    gpu_check.ROWS.clear()
    assert gpu_check.main(["--dry-run", "--part", "kernels"]) == 1
    rows = {c: r for c, _, r in gpu_check.ROWS}
    assert rows["attention dense bfloat16 H=64 decode"] == rows["attention torch fp8_e4m3 H=64 sparse mixed"] == "PASS"
    assert rows["attention dense bfloat16 H=64 sparse decode"] == rows["attention dense fp8_e4m3 H=64 sparse mixed"] \
        == "FAIL"
    gpu_check.ROWS.clear()


def test_sparse_rows_say_the_triton_sparse_kernel_ran(monkeypatch):
    """On a DSA layer the triton row must have run our sparse kernel (mla_sparse) and says so; the same numbers from
    the torch path (sparse_attend, what the Triton kernel ran before mla_sparse) fail the row. The detail of the
    other rows names their path."""
    from splash.attention.dsa import sparse_attend
    from splash.attention.kernels import triton_mla as tm

    monkeypatch.setattr(gpu_check, "kernel_names", lambda backend: ["triton"])
    monkeypatch.setattr(gpu_check, "check_case", lambda *a: None)      # the sparse rows only
    monkeypatch.setattr(gpu_check, "time_decode", lambda *a: None)
    gpu_check.ROWS.clear()
    assert gpu_check.main(["--dry-run", "--part", "kernels"]) == 0
    rows = {c: (d, r) for c, d, r in gpu_check.ROWS}
    for kv in gpu_check.KV_DTYPES:
        for step in ("decode", "mixed"):
            detail, result = rows[f"attention triton {kv} H=64 sparse {step}"]
            assert result == "PASS" and detail.startswith("via triton mla_sparse:"), detail
            assert rows[f"attention torch {kv} H=64 sparse {step}"][0].startswith("dsa.sparse_attend:")
    real = tm.TritonMLAKernel.run

    def torch_sparse(self, layer, ql, qr, cache):
        sel = self.meta.sparse.get(layer)
        return real(self, layer, ql, qr, cache) if sel is None else sparse_attend(ql, qr, cache, layer, sel, self.scale)

    monkeypatch.setattr(tm.TritonMLAKernel, "run", torch_sparse)
    gpu_check.ROWS.clear()
    assert gpu_check.main(["--dry-run", "--part", "kernels"]) == 1
    rows = {c: (d, r) for c, d, r in gpu_check.ROWS}
    detail, result = rows["attention triton bfloat16 H=64 sparse decode"]
    assert result == "FAIL" and detail.startswith("the Triton sparse kernel did not run"), detail
    gpu_check.ROWS.clear()
