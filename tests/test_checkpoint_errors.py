"""Checkpoint loading: every broken checkpoint fails with an error naming the file and the field/tensor, and the
supported storage forms (sharded with an index, FP8 block-scaled, BF16) load to the right numbers."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_models import VARIANTS, hf_logits, load_hf, make_tiny_deepseek, random_prompts
from safetensors.torch import load_file, save_file

from splash.attention.batch import StepBatch, StepRequest
from splash.engine.llm import LLM
from splash.engine.runner import ModelRunner
from splash.models.config import ConfigError, load_model_config
from splash.models.loader import CheckpointError, open_checkpoint
from splash.models.qweight import BLOCK

PROMPT = random_prompts([21], seed=21)[0]


def dequant_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The reference dequantisation: w [out, in] fp8 with scale_inv [ceil(out/128), ceil(in/128)] -> fp32."""
    out, inn = w.shape
    s = scale_inv.float().repeat_interleave(BLOCK, 0)[:out].repeat_interleave(BLOCK, 1)[:, :inn]
    return w.float() * s


def prefill_logits(path, comm, dtype=torch.float32) -> torch.Tensor:
    cfg, get = open_checkpoint(path, dtype)
    runner = ModelRunner(cfg, get, comm, "tp", "float32", 4, 16, dtype)
    n = len(PROMPT)
    return runner.step(StepBatch([StepRequest("a", 0, n)], torch.tensor(PROMPT), torch.arange(n), list(range(n))))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture
def ckpt(tiny_ckpt, tmp_path) -> Path:
    """A private copy of the moe_yarn checkpoint that a test may break."""
    return Path(shutil.copytree(tiny_ckpt("moe_yarn"), tmp_path / "ckpt"))


def _edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path: Path, fn) -> None:
    f = path / "model.safetensors"
    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


# ---- errors ---------------------------------------------------------------------------------------------
def test_missing_config_json(ckpt, comm):
    (ckpt / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"config\.json not found") as e:
        LLM(str(ckpt), comm=comm)
    assert str(ckpt) in str(e.value)


def test_invalid_json_config(ckpt):
    (ckpt / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"config\.json: not valid JSON"):
        load_model_config(ckpt)


def test_unknown_model_type(ckpt, comm):
    _edit_config(ckpt, model_type="llama")
    with pytest.raises(ConfigError) as e:
        LLM(str(ckpt), comm=comm)
    msg = str(e.value)
    assert "'model_type'" in msg and "'llama'" in msg and str(ckpt / "config.json") in msg


def test_missing_required_field(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    del cfg["kv_lora_rank"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=r"config\.json: required field 'kv_lora_rank' is missing"):
        open_checkpoint(ckpt)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(ckpt, comm, damage):
    f = ckpt / "model.safetensors"
    if damage == "garbage":
        f.write_bytes(b"\x13\x37 this is not a safetensors file" * 50)
    else:
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError) as e:
        LLM(str(ckpt), comm=comm)
    assert str(f) in str(e.value) and "safetensors" in str(e.value)


def test_no_safetensors_files(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files"):
        open_checkpoint(ckpt)


def test_missing_tensor(ckpt, comm):
    name = "model.layers.1.self_attn.kv_b_proj.weight"
    _edit_tensors(ckpt, lambda sd: sd.pop(name))
    with pytest.raises(CheckpointError, match="is missing from the checkpoint") as e:
        LLM(str(ckpt), comm=comm)
    assert repr(name) in str(e.value) and str(ckpt) in str(e.value)


def test_tensor_shape_disagrees_with_config(ckpt, comm):
    name = "model.layers.0.self_attn.o_proj.weight"

    def shrink(sd):
        sd[name] = sd[name][:, :-8].contiguous()

    _edit_tensors(ckpt, shrink)
    with pytest.raises(CheckpointError) as e:
        LLM(str(ckpt), comm=comm)
    msg = str(e.value)
    assert repr(name) in msg and str(ckpt / "model.safetensors") in msg and "(64, 120)" in msg and "(64, 128)" in msg


def test_config_disagrees_with_tensors(ckpt, comm):
    _edit_config(ckpt, intermediate_size=96)  # layer 0 is dense with 128
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.\w+_proj\.weight.*config\.json implies"):
        LLM(str(ckpt), comm=comm)


def test_fp8_weight_without_scale(ckpt):
    name = "model.layers.0.self_attn.q_b_proj.weight"

    def to_fp8(sd):
        sd[name] = sd[name].to(torch.float8_e4m3fn)

    _edit_tensors(ckpt, to_fp8)
    _, get = open_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=r"FP8 tensor .*q_b_proj\.weight.* has no .*weight_scale_inv"):
        get(name)


# ---- storage forms that must load -----------------------------------------------------------------------
def test_sharded_checkpoint_with_index(tiny_ckpt, tmp_path, comm):
    sharded = make_tiny_deepseek(tmp_path / "sharded", max_shard_size="40KB", **VARIANTS["moe_yarn"])
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (sharded / "model.safetensors").exists()
    ref = prefill_logits(tiny_ckpt("moe_yarn"), comm)  # same seed, single file
    assert torch.equal(prefill_logits(sharded, comm), ref)
    # an index pointing at a missing shard names that file
    (sharded / shards[-1]).unlink()
    with pytest.raises(CheckpointError, match="checkpoint file is missing") as e:
        LLM(str(sharded), comm=comm)
    assert shards[-1] in str(e.value)


FP8_MODEL = dict(VARIANTS["moe_yarn"], hidden_size=160, intermediate_size=288, q_lora_rank=136)


def _fp8_quantize_blocks(w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-style FP8: w [out, in] -> (fp8 weight, weight_scale_inv [ceil(out/128), ceil(in/128)]).
    Blocks get different magnitudes first so a misplaced scale would show."""
    out, inn = w.shape
    bo, bi = -(-out // 128), -(-inn // 128)
    mag = 10.0 ** (torch.rand(bo, bi, generator=g) * 2 - 1)
    expand = lambda t: t.repeat_interleave(128, 0)[:out].repeat_interleave(128, 1)[:, :inn]  # noqa: E731
    w = w * expand(mag)
    amax = torch.zeros(bo, bi)
    for i in range(bo):
        for j in range(bi):
            amax[i, j] = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].abs().max()
    scale_inv = amax / 448.0
    return (w / expand(scale_inv)).to(torch.float8_e4m3fn), scale_inv


def test_fp8_block_scaled_checkpoint(tmp_path, comm, torch_kernels):
    src = make_tiny_deepseek(tmp_path / "src", **FP8_MODEL)
    sd = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    fp8, deq = {}, {}
    quantized = []
    for name, t in sd.items():
        skip = ("norm", "embed_tokens", "lm_head", "mlp.gate.")
        if t.dim() == 2 and name.endswith(".weight") and not any(s in name for s in skip):
            q, s = _fp8_quantize_blocks(t, g)
            fp8[name], fp8[name[:-len("weight")] + "weight_scale_inv"] = q, s
            deq[name] = dequant_fp8_blocks(q, s)
            quantized.append((name, tuple(s.shape)))
        else:
            fp8[name] = deq[name] = t
    shapes = {s for _, s in quantized}
    assert {(2, 2), (3, 2), (2, 3), (1, 2)} <= shapes, shapes  # multi-block and ragged edges are exercised
    for d, tensors in (("fp8", fp8), ("deq", deq)):
        (tmp_path / d).mkdir()
        shutil.copy(src / "config.json", tmp_path / d / "config.json")
        save_file(tensors, str(tmp_path / d / "model.safetensors"), metadata={"format": "pt"})
    # the dequantisation itself: a block of w equals q * its own block's scale
    name, _ = next(x for x in quantized if x[1] == (3, 2))
    q, s = fp8[name], fp8[name[:-len("weight")] + "weight_scale_inv"]
    assert torch.equal(deq[name][128:256, 128:], q[128:256, 128:].float() * s[1, 1])
    ours = prefill_logits(tmp_path / "fp8", comm)
    assert torch.allclose(ours, prefill_logits(tmp_path / "deq", comm), rtol=0, atol=1e-6)
    # and the dequantised weights give HF's logits (fp8 rounding changed the model, so compare like with like)
    ref = hf_logits(load_hf(tmp_path / "deq"), PROMPT)
    assert rel_err(ours, ref) < 1e-4


def test_bf16_checkpoint(tmp_path, comm):
    path = make_tiny_deepseek(tmp_path / "bf16", dtype=torch.bfloat16, **VARIANTS["moe_yarn"])
    assert all(t.dtype == torch.bfloat16 for t in load_file(str(path / "model.safetensors")).values())
    ref = hf_logits(load_hf(path, torch.float32), PROMPT)  # HF upcasts the bf16 weights to fp32
    assert rel_err(prefill_logits(path, comm), ref) < 1e-4
    # computing in bf16 stays close (bf16 activations: ~3 significant digits)
    assert rel_err(prefill_logits(path, comm, torch.bfloat16), ref) < 0.05
    out = LLM(str(path), dtype="bfloat16", comm=comm).generate([PROMPT], None)[0]
    assert len(out.token_ids) >= 1


def _glm(**changes):
    from splash.sim.presets import PRESETS
    return {**PRESETS["glm-5.3"][0], **changes}


@pytest.mark.parametrize("changes, message", [
    ({"rope_parameters": 3}, "field 'rope_parameters' must be an object, got int"),
    ({"rope_parameters": {"rope_type": "linear"}}, "field 'rope_parameters.rope_type' = 'linear' is not supported"),
    ({"quantization_config": [1]}, "field 'quantization_config' must be an object, got list"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "fmt": "e5m2"}},
     "field 'quantization_config.fmt' = 'e5m2' is not supported"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {}}},
     "field 'quantization_config.config_groups' must be a non-empty object"),
    ({"num_hidden_layers": -1}, "field 'num_hidden_layers' must be a non-negative integer, got -1"),
    ({"num_attention_heads": 0}, "field 'num_attention_heads' must be positive"),
    ({"n_group": 7}, r"field 'n_group' must divide n_routed_experts \(256\)"),
    ({"index_head_dim": 8}, "field 'index_head_dim' must be at least qk_rope_head_dim"),
])
def test_config_json_errors_name_the_field(changes, message):
    from splash.models.config import model_config_from_dict
    with pytest.raises(ConfigError, match=f"^c.json: {message}"):
        model_config_from_dict(_glm(**changes), "c.json")


def test_config_json_mixtral_expert_count_and_eos_list():
    """HF's other spellings: ``num_local_experts`` for the routed experts, a list of EOS ids."""
    from splash.models.config import model_config_from_dict
    raw = _glm(num_local_experts=64, eos_token_id=[3, 5])
    del raw["n_routed_experts"]
    cfg = model_config_from_dict(raw, "c.json")
    assert cfg.n_routed_experts == 64 and cfg.eos_ids == (3, 5)
    assert model_config_from_dict(_glm(eos_token_id=None), "c.json").eos_ids == ()
