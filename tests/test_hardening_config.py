"""Operator mistakes are refused at startup with a message naming the field, the admin token can
come from a file or the environment, and the pure modules stay free of torch (one list per fact)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from splash.cli.args import build_config
from splash.config.serve_config import ServeConfig, ServerSection, load_serve_config
from splash.errors import ConfigError
from splash.server.startup import resolve_admin_token, resolve_api_key

REPO = Path(__file__).resolve().parents[1]


def _load_error(tmp_path: Path, text: str) -> str:
    p = tmp_path / "serve.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError) as ei:
        load_serve_config(p)
    return str(ei.value)


@pytest.mark.parametrize("text, needles", [
    ("server:\n  collective_timeout_s: .nan\n", ["server.collective_timeout_s", "finite"]),
    ("server:\n  read_timeout_s: .inf\n", ["server.read_timeout_s", "finite"]),
    ("cache:\n  layout_kv_dtypes: {[1]: fp8_e4m3}\n", ["cache.layout_kv_dtypes", "line 2", "list"]),
    ("model:\n  max_model_len: 1\n", ["model.max_model_len", ">= 2"]),
    ("server:\n  admin_token: ''\n", ["server.admin_token", "empty"]),
    ("server:\n  admin_token: '  '\n", ["server.admin_token", "empty"]),
    ("server:\n  admin_token: a\n  admin_token_file: /x\n", ["admin_token_file", "both"]),
    ("server:\n  api_key: ' '\n", ["server.api_key", "empty"]),
    ("server:\n  max_request_body_bytes: 0\n", ["server.max_request_body_bytes"]),
])
def test_bad_values_name_the_field(tmp_path, text, needles):
    msg = _load_error(tmp_path, text)
    assert all(n in msg for n in needles), msg


def test_nan_from_the_command_line_is_refused():
    with pytest.raises(ConfigError, match="collective_timeout_s.*finite"):
        build_config(["--collective-timeout-s", "nan"])


def test_admin_token_from_file_or_environment(tmp_path):
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert resolve_admin_token(ServerSection(admin_token_file=str(f)), {}) == "from-file"
    assert resolve_admin_token(ServerSection(), {"SPLASH_ADMIN_TOKEN": "from-env"}) == "from-env"
    assert resolve_admin_token(ServerSection(admin_token="flag"), {"SPLASH_ADMIN_TOKEN": "env"}) == "flag"
    assert resolve_admin_token(ServerSection(), {}) is None
    with pytest.raises(ConfigError, match="SPLASH_ADMIN_TOKEN.*empty"):
        resolve_admin_token(ServerSection(), {"SPLASH_ADMIN_TOKEN": ""})
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="admin_token_file.*empty"):
        resolve_admin_token(ServerSection(admin_token_file=str(tmp_path / "empty")), {})
    with pytest.raises(ConfigError, match="admin_token_file.*cannot read"):
        resolve_admin_token(ServerSection(admin_token_file=str(tmp_path / "missing")), {})


def test_api_key_from_the_config_or_environment():
    assert resolve_api_key(ServerSection(api_key="cfg"), {"SPLASH_API_KEY": "env"}) == "cfg"
    assert resolve_api_key(ServerSection(), {"SPLASH_API_KEY": " env\n"}) == "env"
    assert resolve_api_key(ServerSection(), {}) is None
    with pytest.raises(ConfigError, match="SPLASH_API_KEY.*empty"):
        resolve_api_key(ServerSection(), {"SPLASH_API_KEY": "  "})
    assert build_config(["--api-key", "k1"]).server.api_key == "k1"


def test_shipped_configs_still_load():
    for p in sorted((REPO / "configs").glob("*.yaml")):
        assert isinstance(load_serve_config(p), ServeConfig)


PURE = ["splash", "splash.layouts", "splash.switching.manifest", "splash.engine.scheduler", "splash.engine.ledger",
        "splash.engine.layout_policy.control", "splash.kv.block_manager", "splash.models.config", "splash.config",
        "splash.cli.args", "splash.tokenizer"]


def _python(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_pure_modules_import_no_torch():
    """docs/architecture.md lists these as pure; layout_control used to pull torch in through paged_cache."""
    code = f"import importlib, sys\nfor m in {PURE!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    assert _python(code) == "False"


def test_top_level_api_is_lazy():
    """`from splash import LLM, SamplingParams`, without making `import splash` import torch."""
    out = _python("import sys, splash; a = 'torch' in sys.modules\n"
                  "from splash import LLM, SamplingParams\n"
                  "from splash.engine.llm import LLM as L2\n"
                  "print(a, LLM is L2, SamplingParams(max_tokens=3).max_tokens, 'LLM' in dir(splash))")
    assert out == "False True 3 True"
    with pytest.raises(ImportError):
        exec("from splash import NoSuchThing")


def test_one_list_per_fact():
    """The layout names, the KV dtypes and the head-divisibility rule each have one source."""
    from splash.cli.args import build_parser
    from splash.config import serve_config
    from splash.engine.layout_policy import control as layout_control
    from splash.kv import quant
    from splash.layouts.layout import LAYOUT_NAMES, check_heads, heads_fit
    from splash.layouts.memory import KV_DTYPES

    assert serve_config.LAYOUTS is LAYOUT_NAMES and layout_control.ALL_LAYOUTS is LAYOUT_NAMES
    assert serve_config.KV_CACHE_DTYPES is KV_DTYPES and quant.KV_DTYPES is KV_DTYPES
    kv_flag = next(a for a in build_parser()._actions if a.dest == "kv_cache_dtype")
    assert kv_flag.choices == ("auto",) + KV_DTYPES   # the flag's choices are the config field's
    assert heads_fit("dp_attn", 8, 3) and not heads_fit("dop", 8, 3) and heads_fit("tp", 8, 4)
    with pytest.raises(ValueError, match="does not divide"):
        check_heads("tp", 8, 3)


def test_chunked_prefill_off_never_splits_a_prompt():
    """With chunked prefill off (--no-enable-chunked-prefill) no prompt is split across steps."""
    from splash.engine.ledger import KVLedger
    from splash.engine.scheduler import Request, Scheduler

    def run(chunked: bool) -> list[list[tuple[str, int]]]:
        sched = Scheduler(KVLedger(1, 100, 16, "tp"), max_num_seqs=8, max_num_batched_tokens=64)
        sched.chunked_prefill = chunked
        for i, n in enumerate((40, 50, 10)):
            sched.add(Request(f"r{i}", list(range(n)), max_tokens=1))
        steps = []
        while sched.has_work():
            plan = sched.schedule()
            steps.append([(it.req_id, len(it.tokens)) for it in plan.items])
            sched.update(plan, {it.req_id: 1 for it in plan.items if it.sample})
        return steps

    assert run(True)[0] == [("r0", 40), ("r1", 24)]            # r1 split across steps
    off = run(False)
    assert off[0] == [("r0", 40)] and off[1] == [("r1", 50), ("r2", 10)]   # r1 waits for a step it fits whole
    assert all(n in (40, 50, 10) for step in off for _, n in step)


def test_one_kv_capacity_model():
    """The engine's per-layout KV blocks come from the memory model's capacity function."""
    from splash.engine.build import kv_blocks_per_layout
    from splash.layouts.memory import common_params, kv_block_bytes, kv_capacity_tokens, projection_bytes_per_rank
    from splash.models.presets import preset_config

    cfg = preset_config("small-mla")
    for world in (1, 2, 3, 4):
        caps = kv_blocks_per_layout(cfg, world, "bfloat16", 16, 50 << 20, 2)
        blk = kv_block_bytes(cfg, "bfloat16", 16)
        base = min(projection_bytes_per_rank(cfg, lay, world, 2) for lay in caps)
        rank_bytes = (50 << 20) // blk * blk + base + common_params(cfg, world) * 2
        for lay, n in caps.items():
            assert n == kv_capacity_tokens(cfg, lay, world, rank_bytes, 2, "bfloat16", 16).blocks_per_rank
        assert set(caps) == ({"dp_attn", "cp"} if world == 3 else {"tp", "dp_attn", "cp", "dop"})


def test_chat_template_from_a_file_or_inline(tmp_path):
    from splash.server.startup import serving_tokenizer

    inline = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    f = tmp_path / "t.jinja"
    f.write_text(inline)
    msgs = [{"role": "user", "content": "hi"}]
    for value in (str(f), inline):
        tok = serving_tokenizer(build_config(["--chat-template", value]), 320)
        assert tok.apply_chat_template(msgs) == "[user] hi\n"
    assert serving_tokenizer(build_config([]), 320).chat_template is None   # the byte tokenizer has none
    for value, needle in (("/no/such/file.jinja", "neither a file nor a template"),
                          ("{% for m in messages %}", "not a valid Jinja template")):
        with pytest.raises(ConfigError, match=needle) as e:
            serving_tokenizer(build_config(["--chat-template", value]), 320)
        assert "model.chat_template" in str(e.value)


def test_sampling_defaults_from_generation_config(tmp_path):
    import json

    from splash.server.startup import sampling_defaults

    model = tmp_path / "model"
    model.mkdir()
    cfg = build_config(["--model", str(model)])
    assert sampling_defaults(cfg) == {}   # auto without the file: none
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 64, "do_sample": True, "eos_token_id": 1}))
    assert sampling_defaults(cfg) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 64}
    assert sampling_defaults(build_config(["--model", str(model), "--generation-config", "vllm"])) == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1}))
    assert sampling_defaults(build_config(["--generation-config", str(other)])) == {"repetition_penalty": 1.1}
    (other / "generation_config.json").write_text(json.dumps({"temperature": 7}))
    with pytest.raises(ConfigError, match="generation_config.json.*temperature"):
        sampling_defaults(build_config(["--generation-config", str(other)]))
    (other / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(ConfigError, match="generation_config.json: invalid value for 'max_new_tokens'"):
        sampling_defaults(build_config(["--generation-config", str(other)]))   # the file's key, not the field's
    with pytest.raises(ConfigError, match="model.generation_config.*does not exist"):
        sampling_defaults(build_config(["--generation-config", str(tmp_path / "none")]))
