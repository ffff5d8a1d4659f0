"""FP8 block-scaled and compressed-tensors INT8 checkpoints load and stay quantised; `quantization=` quantises a
plain checkpoint at load; every unsupported quantised form is an error naming the tensor and the format."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import VARIANTS, hf_logits, load_hf, make_tiny_deepseek, random_prompts
from quant_ckpt import fp8_blocks, write_quantized
from safetensors.torch import load_file, save_file

from splash.attention.batch import StepBatch, StepRequest
from splash.engine.llm import LLM
from splash.engine.runner import ModelRunner
from splash.engine.sampling import SamplingParams
from splash.layouts.memory import rank_weight_bytes
from splash.models.config import ConfigError
from splash.models.loader import CheckpointError, open_checkpoint
from splash.models.qweight import QuantWeight, quantize_fp8_blocks
from splash.models.weights import resident_bytes

# multi-block and ragged weights (hidden 160, q_lora 136, FFN 288), KV-B 56 rows per head, Q-B 32: head shards
# at 2 and 4 ranks start inside 128-row blocks
QMODEL = dict(VARIANTS["moe_yarn"], hidden_size=160, intermediate_size=288, q_lora_rank=136, kv_lora_rank=48,
              qk_nope_head_dim=24, v_head_dim=32)
PROMPT = random_prompts([19], seed=19)[0]
SCHEMES = ["fp8", "w8a8", "w8a16"]


@pytest.fixture(scope="module")
def qckpts(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    d = tmp_path_factory.mktemp("qckpt")
    src = make_tiny_deepseek(d / "src", **QMODEL)
    return {"src": (src, src), **{s: write_quantized(src, d, s, spread_seed=3 if s == "fp8" else None)
                                  for s in SCHEMES}}


def prefill(path, comm, dtype=torch.float32, quantization=None):
    cfg, get = open_checkpoint(path, dtype, quantization)
    runner = ModelRunner(cfg, get, comm, "tp", "float32", 4, 16, dtype)
    n = len(PROMPT)
    batch = StepBatch([StepRequest("a", 0, n)], torch.tensor(PROMPT), torch.arange(n), list(range(n)))
    return runner, runner.step(batch)


def rel_err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("scheme", SCHEMES)
def test_quantized_checkpoint_stays_quantized(qckpts, comm, scheme, torch_kernels):
    """Weights stay in stored form (1 byte per value + scales: resident bytes equal the memory model); logits
    equal the engine's on the dequantised checkpoint and are within 1e-4 of HF there; greedy tokens are the same."""
    qdir, ddir = qckpts[scheme]
    runner, logits = prefill(qdir, comm)
    fmt = "fp8" if scheme == "fp8" else "int8"
    assert runner.weight_quant == fmt and runner.cfg.quantization == fmt
    a = runner.weights.layers[1].attn
    assert all(isinstance(w, QuantWeight) and w.fmt == fmt for w in (a.q_b, a.kv_b, a.o, a.q_a, a.kv_a))
    assert resident_bytes(runner.weights) == rank_weight_bytes(runner.cfg, "tp", 1, 0, 4, fmt)
    ref_runner, ref = prefill(ddir, comm)
    assert resident_bytes(ref_runner.weights) == rank_weight_bytes(runner.cfg, "tp", 1, 0, 4)
    assert resident_bytes(runner.weights) < resident_bytes(ref_runner.weights) / 2  # fp32 embeddings stay
    assert torch.allclose(logits, ref, rtol=0, atol=1e-6)
    assert rel_err(logits, hf_logits(load_hf(ddir), PROMPT)) < 1e-4
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = random_prompts([7, 23], seed=4)
    got = [o.token_ids for o in LLM(str(qdir), comm=comm).generate(prompts, sp)]
    assert got == [o.token_ids for o in LLM(str(ddir), comm=comm).generate(prompts, sp)]


def test_bf16_compute_on_fp8_checkpoint(qckpts, comm):
    """Dequantised per use into bf16: the same numbers as the dequantised checkpoint computed in bf16."""
    qdir, ddir = qckpts["fp8"]
    _, logits = prefill(qdir, comm, torch.bfloat16)
    _, ref = prefill(ddir, comm, torch.bfloat16)
    assert torch.allclose(logits, ref, rtol=0, atol=1e-6)


def test_our_fp8_quantizer_matches_the_test_writer():
    """splash's vectorised quantiser and the test's loop quantiser give the same bytes and scales."""
    w = torch.randn(300, 200) * 3
    q, s = quantize_fp8_blocks(w)
    q2, s2 = fp8_blocks(w)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_at_load(qckpts, comm, tmp_path, fmt, dtype, torch_kernels):
    """`quantization=` on a BF16/FP32 checkpoint stores its linear weights quantised; the result equals the
    engine on those weights dequantised (written as a plain checkpoint)."""
    src = qckpts["src"][0]
    if dtype == torch.bfloat16:
        src = make_tiny_deepseek(tmp_path / "bf16", dtype=torch.bfloat16, **QMODEL)
    runner, logits = prefill(src, comm, torch.float32, fmt)
    assert runner.weight_quant == fmt
    cfg, get = open_checkpoint(src, torch.float32, fmt)
    sd = {n: (get(n).dequant() if isinstance(get(n), QuantWeight) else t.float())
          for n, t in load_file(str(src / "model.safetensors")).items()}
    ref_dir = tmp_path / "ref"
    shutil.copytree(src, ref_dir)
    save_file(sd, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    assert torch.allclose(logits, prefill(ref_dir, comm)[1], rtol=0, atol=1e-6)
    assert resident_bytes(runner.weights) == rank_weight_bytes(cfg, "tp", 1, 0, 4, fmt)
    sp = SamplingParams(max_tokens=3, ignore_eos=True)
    out = LLM(str(src), comm=comm, quantization=fmt).generate([PROMPT], sp)[0]
    assert len(out.token_ids) == 3


def test_quantization_of_a_preset(comm):
    llm = LLM(preset="tiny-mla", comm=comm, quantization="int8", num_kv_blocks=32)
    assert llm.runner.weight_quant == "int8" and llm.engine.control.weight_quant == "int8"
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))[0].token_ids) == 2


# ---- errors ---------------------------------------------------------------------------------------------
def _copy(qckpts, scheme, tmp_path) -> Path:
    return Path(shutil.copytree(qckpts[scheme][0], tmp_path / "bad"))


def _edit(path: Path, fn) -> None:
    f = path / "model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


def _edit_qc(path: Path, fn) -> None:
    c = json.loads((path / "config.json").read_text())
    fn(c["quantization_config"])
    (path / "config.json").write_text(json.dumps(c))


W = "model.layers.1.self_attn.kv_b_proj.weight"
TENSOR_ERRORS = {
    "int8 without scale": ("w8a8", lambda sd: sd.pop(W[:-6] + "weight_scale"), r"INT8 with no .*weight_scale"),
    "group-wise int8": ("w8a8", lambda sd: sd.__setitem__(W[:-6] + "weight_scale", torch.ones(sd[W].shape[0], 4)),
                        r"group-wise"),
    "asymmetric int8": ("w8a8", lambda sd: sd.__setitem__(W[:-6] + "weight_zero_point",
                                                         torch.ones(sd[W].shape[0], 1, dtype=torch.int8)),
                        r"weight_zero_point .*asymmetric"),
    "pack-quantized": ("w8a8", lambda sd: sd.__setitem__(W[:-6] + "weight_packed", sd.pop(W).view(torch.int32)),
                       r"weight_packed.*pack-quantized"),
    "uint8 weight": ("w8a8", lambda sd: sd.__setitem__(W, sd[W].view(torch.uint8)), r"torch\.uint8.*not a weight"),
    "fp8 with weight_scale": ("fp8", lambda sd: sd.__setitem__(W[:-6] + "weight_scale", sd.pop(W[:-6] +
                                                                                          "weight_scale_inv")),
                              r"weight_scale .*compressed-tensors float-quantized"),
    "fp8 e5m2": ("fp8", lambda sd: sd.__setitem__(W, sd[W].float().to(torch.float8_e5m2)), r"float8_e5m2"),
    "wrong block grid": ("fp8", lambda sd: sd.__setitem__(W[:-6] + "weight_scale_inv", torch.ones(4, 4)),
                         r"weight_scale_inv of shape \(4, 4\), not the \(4, 1\) of 128×128 blocks"),
    "quantised norm": ("w8a8", lambda sd: (sd.__setitem__("model.norm.weight", torch.ones(160, dtype=torch.int8)),
                                           sd.__setitem__("model.norm.weight_scale", torch.ones(160, 1))),
                       r"'model\.norm\.weight' is stored as torch\.int8, but only linear projection weights"),
}


@pytest.mark.parametrize("case", sorted(TENSOR_ERRORS))
def test_unknown_quantized_tensor_is_an_error(qckpts, comm, tmp_path, case):
    scheme, damage, pattern = TENSOR_ERRORS[case]
    bad = _copy(qckpts, scheme, tmp_path)
    _edit(bad, damage)
    with pytest.raises(CheckpointError, match=pattern) as e:
        LLM(str(bad), comm=comm)
    assert str(bad / "model.safetensors") in str(e.value)


CONFIG_ERRORS = {
    "gptq": ("w8a8", lambda qc: qc.__setitem__("quant_method", "gptq"),
             r"'quantization_config\.quant_method' = 'gptq'"),
    "fp8 per-tensor": ("fp8", lambda qc: qc.pop("weight_block_size"), r"weight_block_size' = None"),
    "fp8 64 blocks": ("fp8", lambda qc: qc.__setitem__("weight_block_size", [64, 64]), r"\[64, 64\]"),
    "int4": ("w8a8", lambda qc: qc["config_groups"]["group_0"]["weights"].__setitem__("num_bits", 4),
             r"config_groups\.group_0\.weights.*\(4, 'int', True, 'channel'\)"),
    "pack format": ("w8a16", lambda qc: qc.__setitem__("format", "pack-quantized"), r"'pack-quantized'"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_ERRORS))
def test_unknown_quantization_config_is_an_error(qckpts, comm, tmp_path, case):
    scheme, damage, pattern = CONFIG_ERRORS[case]
    bad = _copy(qckpts, scheme, tmp_path)
    _edit_qc(bad, damage)
    with pytest.raises(ConfigError, match=pattern) as e:
        LLM(str(bad), comm=comm)
    assert str(bad / "config.json") in str(e.value)


def test_requantising_is_refused(qckpts, comm):
    with pytest.raises(ConfigError, match="already quantised as fp8"):
        LLM(str(qckpts["fp8"][0]), comm=comm, quantization="int8")
    with pytest.raises(ConfigError, match="'nf4' is not one of fp8, int8"):
        LLM(str(qckpts["src"][0]), comm=comm, quantization="nf4")


def test_serve_config_and_flag():
    from splash.cli.args import build_config
    from splash.config.serve_config import ModelSection

    assert build_config(["--quantization", "fp8"]).model.quantization == "fp8"
    assert build_config([]).model.quantization is None
    with pytest.raises(ConfigError, match="--quantization: invalid choice: 'nf4'"):
        build_config(["--quantization", "nf4"])
    with pytest.raises(ConfigError, match="model.quantization"):
        ModelSection(quantization="int4")
