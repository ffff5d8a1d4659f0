"""Backend registry (backends/): names, lazy imports, clear errors for missing hardware or packages, and the
GPU configs validating on CPU (`splash-serve --config X --check`) while start fails only for the hardware."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import backends
from splash.sim.presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
GPU = torch.cuda.is_available()
BIN = Path(sys.executable).parent


def _serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(BIN / "splash-serve"), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_names_and_auto():
    assert backends.NAMES == ("cpu", "cuda", "hip", "auto")
    assert backends.get_backend("cpu").device == torch.device("cpu")
    if not GPU:
        assert backends.detect() == "cpu" and backends.get_backend("auto").name == "cpu"
    with pytest.raises(backends.BackendUnavailable, match="unknown backend 'tpu'"):
        backends.get_backend("tpu")


@pytest.mark.skipif(GPU, reason="this machine has a GPU")
@pytest.mark.parametrize("name,needs", [("cuda", "CUDA build of torch"), ("hip", "ROCm build of torch")])
def test_gpu_backend_without_gpu_names_the_missing_piece(name, needs):
    with pytest.raises(backends.BackendUnavailable, match=needs):
        backends.get_backend(name)


def test_attention_kernel_checks(monkeypatch):
    with pytest.raises(backends.BackendUnavailable, match="does not run on backend 'cpu'"):
        backends.check_attention("cpu", "flashinfer")
    real = backends.importlib.util.find_spec
    monkeypatch.setattr(backends.importlib.util, "find_spec", lambda n: None if n == "triton" else real(n))
    with pytest.raises(backends.BackendUnavailable, match=r"needs triton.*splash\[cuda\]"):
        backends.check_attention("cpu", "triton")
    assert backends.missing_packages("aiter")[0] == "aiter" and "not on PyPI" in backends.INSTALL_HINT["aiter"]


def test_cpu_run_imports_no_gpu_package():
    code = ("import sys, backends, backends.cuda, backends.hip, splash.cli.serve, splash.server.startup\n"
            "from splash.engine.llm import LLM\n"
            "from splash.engine.sampling import SamplingParams\n"
            "llm = LLM(preset='tiny-mla', layout='tp', num_kv_blocks=16)\n"
            "assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0].token_ids\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('flashinfer', 'aiter', 'triton'))\n"
            "assert not bad, bad\nprint('clean')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0 and "clean" in out.stdout, out.stdout + out.stderr


@pytest.mark.skipif(GPU, reason="this machine has a GPU")
def test_serve_with_cuda_on_cpu_exits_2_naming_it():
    r = _serve("--backend", "cuda", "--port", "0")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error: backend 'cuda' needs an NVIDIA GPU and a CUDA build of torch" in r.stderr


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """splash-serve's entry point in this process (no subprocess: --check and startup errors need no ranks)."""
    from splash.cli.serve import main
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("name,model_type,backend", [("b200", "glm_moe_dsa", "cuda"), ("h200", "deepseek_v32", "cuda"),
                                                     ("dcu", "glm5_next", "hip")])
def test_gpu_configs_check_on_cpu_and_start_fails_for_hardware_only(capsys, name, model_type, backend):
    rc, out, err = _main(capsys, "--config", f"configs/{name}.yaml", "--check")
    assert rc == 0, out + err
    for part in ("config    valid", f": {model_type},", "ranks     8", f"backend   {backend}", "layouts   auto over",
                 "KV pool", "distinct tokens the group holds: tp"):
        assert part in out, out
    if not GPU:
        assert "start would fail here" in out and f"backend {backend!r} needs" in out, out
        rc, out, err = _main(capsys, "--config", f"configs/{name}.yaml")
        assert rc == 2 and f"error: backend {backend!r} needs" in err, out + err


def test_check_with_a_model_type_not_loadable_yet(capsys, tmp_path):
    raw = dict(PRESETS["glm-5.3"][0], model_type="kimi_linear")   # an architecture SPLASH does not implement
    (tmp_path / "config.json").write_text(json.dumps(raw))
    rc, out, err = _main(capsys, "--model", str(tmp_path), "--check")
    assert rc == 0, out + err
    assert "start would fail here" in out, out
    assert "field 'model_type' = 'kimi_linear' is not supported" in out, out


def test_check_rejects_a_bad_config(capsys):
    rc, out, err = _main(capsys, "--config", "configs/cpu.yaml", "--block-size", "0", "--check")
    assert rc == 2 and err.startswith("error: "), out + err
    rc, out, err = _main(capsys, "--config", "configs/cpu.yaml", "--preset", "nope", "--check")
    assert rc == 2 and "error: field 'model.preset': unknown preset 'nope' (available: " in err, out + err


def test_check_of_a_model_directory_not_on_this_machine(capsys, tmp_path):
    """Valid, but start would fail: the report names the directory (no preset is named like it)."""
    missing = tmp_path / "no-such-model"
    rc, out, err = _main(capsys, "--model", str(missing), "--check")
    assert rc == 0, out + err
    assert f"model     {missing}\n" in out and "ranks     2 (cpu profile group" in out
    assert f"start would fail here:\n  - model directory {missing} is not on this machine" in out, out


def test_installed_triton_targets_amd_archs_but_not_hygon_dcus():
    """Asked of Triton itself (an ahead-of-time compile, no GPU): upstream Triton compiles for gfx942 and refuses
    the Hygon DCU arch gfx936."""
    pytest.importorskip("triton")
    from backends.hip.arch import triton_target_error
    assert triton_target_error("gfx942") is None
    assert "unsupported target" in triton_target_error("gfx936")


def test_hip_startup_exits_2_naming_the_arch_and_what_to_install(monkeypatch):
    """A ROCm device whose arch the installed Triton cannot compile for: get_backend (so splash-serve, exit 2)
    refuses aiter and triton alike, naming the arch and the vendor's Triton; torch needs no such check."""
    import backends.hip.aiter_mla as ai
    import backends.hip.arch as arch
    monkeypatch.setattr(backends, "_check_gpu", lambda name: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(backends, "missing_packages", lambda kernel: [])
    monkeypatch.setattr(ai, "device_arch", lambda device: "gfx936")
    monkeypatch.setattr(arch, "triton_target_error", lambda a: f"error: unsupported target: '{a}'")
    for attention in ("aiter", "triton"):
        with pytest.raises(backends.BackendUnavailable, match=r"gfx936.*unsupported target.*Hygon's DTK"):
            backends.get_backend("hip", 3, attention=attention)
    assert backends.get_backend("hip", 3, attention="torch").device == torch.device("cuda:3")
    from splash.cli.args import build_config
    from splash.server import startup
    dcu = build_config(["--config", str(ROOT / "configs" / "dcu.yaml")])
    with pytest.raises(backends.BackendUnavailable, match=r"parallel.attention_backend.*gfx936.*DTK"):
        startup.resolve_backend(dcu, 0)                                   # splash-serve's start path
    monkeypatch.setattr(ai, "device_arch", lambda device: "gfx942")
    monkeypatch.setattr(arch, "triton_target_error", lambda a: None)
    assert backends.get_backend("hip", 3, attention="aiter").name == "hip"
    assert startup.resolve_backend(dcu, 0)[1].name == "hip"


def test_hip_extra_leaves_rocm_triton_alone():
    """[hip] installs no triton: a ROCm torch's own Triton (pytorch-triton-rocm) or a DCU vendor's stays."""
    import tomllib
    extras = tomllib.load(open(ROOT / "pyproject.toml", "rb"))["project"]["optional-dependencies"]
    assert not [d for d in extras["hip"] if d.startswith("triton")]


def test_gpu_backend_makes_its_device_current(monkeypatch):
    """Rank r's backend makes cuda:(r % GPUs) the current device: Triton and AITER launch on the current device,
    so without it every rank's kernels would run on cuda:0 while its tensors sit on cuda:r."""
    current = []
    monkeypatch.setattr(backends, "_check_gpu", lambda name: 4)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    assert backends.get_backend("cuda", 6).device == torch.device("cuda:2")
    assert current == [torch.device("cuda:2")]


def test_ranks_that_share_a_gpu_each_budget_their_share_of_it(monkeypatch):
    """More ranks than GPUs (rank r on GPU r % GPUs): each rank's memory_info is its equal share of the GPU — the
    total split, less its share of what is in use — so two ranks on one GPU do not both budget all of it."""
    from backends.base import ranks_on_gpu, share_of

    assert [ranks_on_gpu(r, 2, 1) for r in range(2)] == [2, 2]
    assert [ranks_on_gpu(r, 3, 2) for r in range(3)] == [2, 1, 2]        # GPU 0: ranks 0 and 2; GPU 1: rank 1
    assert [ranks_on_gpu(r, 8, 8) for r in range(8)] == [1] * 8
    assert share_of(60, 100, 1) == (60, 100) and share_of(60, 100, 2) == (30, 50)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (70 << 30, 140 << 30))
    assert backends.Backend("cuda", "cuda:0", 2).memory_info() == (35 << 30, 70 << 30)
    assert backends.Backend("cuda", "cuda:0").memory_info() == (70 << 30, 140 << 30)
    monkeypatch.setattr(backends, "_check_gpu", lambda name: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    assert backends.get_backend("cuda", 1, local_size=2).ranks_on_device == 2
    assert backends.get_backend("cuda", 0).ranks_on_device == 1


def test_a_gpu_without_a_configured_profile_takes_the_one_its_name_matches(monkeypatch):
    """layout.hardware_profile unset on a GPU: start takes the shipped profile the device's name matches, so auto
    prices layouts for that part; a profile the config names wins; an unknown GPU gets none."""
    from splash.cli.args import build_config
    from splash.costmodel.profile import profile_for_device
    from splash.server import startup

    assert [profile_for_device(n) for n in ("NVIDIA H200", "NVIDIA B200", "NVIDIA H100 80GB HBM3")] == \
        ["h200", "b200", None]
    monkeypatch.setattr(backends, "_check_gpu", lambda name: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(backends, "missing_packages", lambda kernel: [])
    name = ["NVIDIA H200"]
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name[0])
    bare = build_config(["--backend", "cuda", "--attention-backend", "torch"])
    assert bare.hardware_profile is None
    assert startup.resolve_backend(bare, 0)[0].hardware_profile == "h200"
    told = build_config(["--backend", "cuda", "--attention-backend", "torch", "--hardware-profile", "b200"])
    assert startup.resolve_backend(told, 0)[0].hardware_profile == "b200"
    name[0] = "NVIDIA H100 80GB HBM3"
    assert startup.resolve_backend(bare, 0)[0].hardware_profile is None
