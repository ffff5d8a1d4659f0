"""Serving config: YAML loading errors, validation, CLI overrides, shipped configs."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from splash.cli.args import build_config, build_parser, main_guard
from splash.config.serve_config import (
    CacheSection,
    ServeConfig,
    apply_overrides,
    load_serve_config,
)
from splash.config.yaml_loader import parse_size
from splash.errors import ConfigError

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _write(tmp_path: Path, text: str, name: str = "serve.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


def _as_yaml(cfg: ServeConfig) -> str:
    """The config as a YAML file would hold it (tuples as lists)."""
    import yaml
    return yaml.safe_dump(json.loads(json.dumps(dataclasses.asdict(cfg))))


def _error(path: Path) -> str:
    with pytest.raises(ConfigError) as ei:
        load_serve_config(path)
    return str(ei.value)


def test_defaults_resolve_for_cpu():
    cfg = ServeConfig()
    assert cfg.compute_dtype == "float32" and cfg.kv_dtype == "float32"
    assert cfg.attention_backend == "torch" and cfg.hardware_profile == "cpu"
    assert cfg.model_name == "tiny-mla" and cfg.layout.allowed_layouts == ("tp", "dp_attn", "cp", "dop")


def test_gpu_backend_resolves_bf16():
    cfg = apply_overrides(ServeConfig(), {"backend": "cuda"})
    assert cfg.compute_dtype == "bfloat16" and cfg.attention_backend == "flashinfer"


def test_unknown_key_names_key_file_and_suggestion(tmp_path):
    p = _write(tmp_path, "cache:\n  blok_size: 32\n")
    msg = _error(p)
    assert "blok_size" in msg and str(p) in msg and "did you mean 'block_size'" in msg


def test_misplaced_key_points_to_its_section(tmp_path):
    msg = _error(_write(tmp_path, "scheduler:\n  block_size: 32\n"))
    assert "'block_size'" in msg and "cache.block_size" in msg


def test_unknown_section(tmp_path):
    p = _write(tmp_path, "servr:\n  port: 1\n")
    msg = _error(p)
    assert "servr" in msg and "did you mean 'server'" in msg and str(p) in msg


def test_wrong_type_names_field_type_and_file(tmp_path):
    p = _write(tmp_path, "server:\n  port: '8000'\n")
    msg = _error(p)
    assert "server.port" in msg and "must be int" in msg and str(p) in msg


def test_bool_is_not_an_int(tmp_path):
    assert "cache.block_size" in _error(_write(tmp_path, "cache:\n  block_size: true\n"))


def test_int_accepted_for_float(tmp_path):
    cfg = load_serve_config(_write(tmp_path, "layout:\n  switch_margin: 0\n"))
    assert cfg.layout.switch_margin == 0.0 and isinstance(cfg.layout.switch_margin, float)


def test_bad_enum_value(tmp_path):
    msg = _error(_write(tmp_path, "layout:\n  layout: dp-attn\n"))
    assert "layout.layout" in msg and "'dp-attn'" in msg and "dp_attn" in msg


@pytest.mark.parametrize("text, field", [
    ("cache:\n  block_size: 0\n", "cache.block_size"),
    ("cache:\n  gpu_memory_utilization: 1.5\n", "cache.gpu_memory_utilization"),
    ("server:\n  port: 70000\n", "server.port"),
    ("layout:\n  allowed_layouts: [tp, xx]\n", "layout.allowed_layouts"),
    ("layout:\n  layout: cp\n  allowed_layouts: [tp]\n", "layout.layout"),
    ("layout:\n  hardware_profile: h100\n", "layout.hardware_profile"),
    ("parallel:\n  attention_backend: flashinfer\n", "parallel.attention_backend"),
    ("scheduler:\n  max_num_seqs: 64\n  max_num_batched_tokens: 32\n", "scheduler.max_num_batched_tokens"),
])
def test_bad_values_name_the_field(tmp_path, text, field):
    assert field in _error(_write(tmp_path, text))


def test_yaml_syntax_error_has_line(tmp_path):
    p = _write(tmp_path, "server:\n  port: 8000\n  host: [unclosed\n")
    msg = _error(p)
    assert str(p) in msg and "YAML syntax error" in msg and f"{p}:" in msg


def test_duplicate_key_is_an_error(tmp_path):
    msg = _error(_write(tmp_path, "server:\n  port: 1\n  port: 2\n"))
    assert "duplicate key 'port'" in msg and "line 3" in msg


def test_missing_file(tmp_path):
    p = tmp_path / "nope.yaml"
    msg = _error(p)
    assert str(p) in msg and "not found" in msg


@pytest.mark.parametrize("text", ["- a\n- b\n", "42\n"])
def test_top_level_must_be_mapping(tmp_path, text):
    assert "top level must be a mapping" in _error(_write(tmp_path, text))


def test_empty_file_and_empty_section_are_defaults(tmp_path):
    assert load_serve_config(_write(tmp_path, "")) == ServeConfig()
    assert load_serve_config(_write(tmp_path, "cache:\n", "b.yaml")) == ServeConfig()


def test_size_strings():
    assert parse_size("64MiB") == 64 * 2**20 and parse_size("2GB") == 2 * 10**9 and parse_size("4096") == 4096
    assert CacheSection(kv_cache_memory_bytes="1KiB").kv_cache_memory_bytes == 1024
    with pytest.raises(ValueError):
        parse_size("lots")


def test_apply_overrides_bare_and_qualified_names():
    cfg = apply_overrides(ServeConfig(), {"port": 9000, "cache.block_size": 32})
    assert cfg.server.port == 9000 and cfg.cache.block_size == 32
    assert cfg.scheduler == ServeConfig().scheduler


def test_apply_overrides_errors():
    with pytest.raises(ConfigError, match="did you mean 'port'"):
        apply_overrides(ServeConfig(), {"prot": 1})
    with pytest.raises(ConfigError, match="server.port.*must be int"):
        apply_overrides(ServeConfig(), {"port": "x"})
    for key in ("cache.port", ".port", "bogus.port", "server.port.x"):   # a qualified name names the field's section
        with pytest.raises(ConfigError, match="unknown key"):
            apply_overrides(ServeConfig(), {key: 9000})


def test_sections_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServeConfig().server.port = 1  # type: ignore[misc]


def test_cli_overrides_beat_yaml(tmp_path):
    p = _write(tmp_path, "server:\n  port: 8100\n  host: 0.0.0.0\ncache:\n  block_size: 32\n")
    cfg = build_config(["--config", str(p), "--port", "9001", "--kv-dtype", "bfloat16", "--quiet"])
    assert cfg.server.port == 9001 and cfg.cache.kv_cache_dtype == "bfloat16" and cfg.server.quiet
    # fields not given on the command line keep the YAML values
    assert cfg.server.host == "0.0.0.0" and cfg.cache.block_size == 32


def test_cli_flags_not_given_do_not_override(tmp_path):
    p = _write(tmp_path, "scheduler:\n  enable_chunked_prefill: false\n  max_num_batched_tokens: 4096\n")
    assert build_config(["--config", str(p)]) == load_serve_config(p)
    assert build_config(["--config", str(p), "--enable-chunked-prefill"]).scheduler.enable_chunked_prefill


def test_model_flag_without_config(tmp_path):
    cfg = build_config(["--model", str(tmp_path)])
    assert cfg.model.model == str(tmp_path) and cfg.tokenizer_path == str(tmp_path)
    assert cfg.model_name == tmp_path.name
    assert dataclasses.replace(cfg, model=ServeConfig().model) == ServeConfig()


def test_cli_all_flags_parse():
    cfg = build_config([
        "--preset", "tiny-mla", "--layout", "tp", "--host", "0.0.0.0", "--kv-cache-dtype", "int8",
        "--block-size", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "64", "--seed", "3",
        "--admin-token", "s3cret", "--switch-mode", "blocking", "--dtype", "bfloat16", "--backend", "hip",
        "--kv-cache-memory-bytes", "64MiB", "--allowed-layouts", "tp,cp"])
    assert cfg.layout.layout == "tp" and cfg.layout.allowed_layouts == ("tp", "cp")
    assert cfg.cache.kv_cache_memory_bytes == 64 * 2**20 and cfg.parallel.backend == "hip" and cfg.block_size == 64
    assert cfg.server.admin_token == "s3cret" and cfg.model.seed == 3 and cfg.compute_dtype == "bfloat16"


@pytest.mark.parametrize("argv, needle", [
    (["--port", "eighty"], "--port"),
    (["--bogus"], "--bogus"),
    (["--layout", "tpp"], "--layout"),
    (["--port", "-1"], "server.port"),
    (["--config", "/nonexistent/x.yaml"], "/nonexistent/x.yaml"),
])
def test_cli_errors_are_config_errors(argv, needle):
    with pytest.raises(ConfigError) as ei:
        build_config(argv)
    assert needle in str(ei.value)


def test_help_shows_example(capsys):
    with pytest.raises(SystemExit) as ei:
        build_parser().parse_args(["--help"])
    assert ei.value.code == 0
    out = capsys.readouterr().out
    assert "mpirun -n 4 splash-serve --config configs/cpu.yaml" in out and "--kv-dtype" in out


def test_main_guard(capsys):
    guarded = main_guard(lambda argv: build_config(argv) and 0)
    assert guarded(["--port", "1"]) == 0
    assert guarded(["--bogus"]) == 2
    assert capsys.readouterr().err.startswith("error: unrecognized arguments: --bogus")


@pytest.mark.parametrize("name", ["cpu", "dcu", "b200", "h200"])
def test_shipped_configs_load(name):
    cfg = load_serve_config(CONFIGS / f"{name}.yaml")
    assert cfg.hardware_profile == ("bw1000" if name == "dcu" else name)
    if name == "cpu":
        assert cfg.model.model is None and cfg.model.preset == "tiny-mla"
        assert cfg.kv_dtype == "float32" and cfg.cache.kv_cache_memory_bytes == 64 * 2**20
        assert (cfg.server.host, cfg.server.port) == ("127.0.0.1", 8000)
    else:
        assert cfg.compute_dtype == "bfloat16" and cfg.kv_dtype == "fp8_e4m3"
        assert cfg.parallel.backend == ("hip" if name == "dcu" else "cuda")


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_parses_from_cli(path):
    assert build_config(["--config", str(path)]) == load_serve_config(path)


def test_yaml_round_trips(tmp_path):
    cfg = load_serve_config(CONFIGS / "dcu.yaml")
    p = _write(tmp_path, _as_yaml(cfg))
    assert load_serve_config(p) == cfg


def test_layout_kv_dtypes(tmp_path):
    cfg = load_serve_config(_write(tmp_path, "cache:\n  layout_kv_dtypes: {dop: fp8_e4m3, tp: bfloat16}\n"))
    assert cfg.cache.layout_kv_dtypes == {"dop": "fp8_e4m3", "tp": "bfloat16"}
    assert load_serve_config(_write(tmp_path, _as_yaml(cfg))) == cfg
    assert ServeConfig().cache.layout_kv_dtypes is None
    err = _error(_write(tmp_path, "cache:\n  layout_kv_dtypes: {dopp: int8}\n"))
    assert "cache.layout_kv_dtypes" in err and "'dopp'" in err and "did you mean 'dop'" in err
    err = _error(_write(tmp_path, "cache:\n  layout_kv_dtypes: {cp: fp4}\n"))
    assert "cache.layout_kv_dtypes.cp" in err and "'fp4'" in err
    assert "must be a mapping" in _error(_write(tmp_path, "cache:\n  layout_kv_dtypes: [int8]\n"))
    with pytest.raises(ConfigError, match="cache.layout_kv_dtypes.dop"):
        CacheSection(layout_kv_dtypes={"dop": "auto"})


def test_build_engine_uses_layout_kv_dtypes():
    from splash.config.serve_config import serve_config_from_dict
    from splash.distributed.communicator import SingleRankCommunicator
    from splash.server.startup import build_engine

    cfg = serve_config_from_dict({"layout": {"layout": "dop"}, "cache": {
        "layout_kv_dtypes": {"dop": "int8"}, "kv_cache_memory_bytes": "1MiB"}})
    comm = SingleRankCommunicator()
    engine = build_engine(cfg, comm, comm)
    runner = engine.runner
    assert runner.kv_dtype == runner.cache.kv_dtype == "int8" and runner.layout_kv_dtypes["tp"] == "float32"
    assert engine.control.kv_dtypes["dop"] == "int8"


@pytest.mark.parametrize("on", [False, True])
def test_build_engine_honours_enable_prefix_caching(on):
    from splash.config.serve_config import serve_config_from_dict
    from splash.distributed.communicator import SingleRankCommunicator
    from splash.server.startup import build_engine

    cfg = serve_config_from_dict({"cache": {"enable_prefix_caching": on, "kv_cache_memory_bytes": "1MiB"}})
    comm = SingleRankCommunicator()
    assert build_engine(cfg, comm, comm).ledger.prefix is on


class _TwoRanks:
    """A world of two for building one rank's engine: only the size matters, building needs no collective."""
    size, rank = 2, 0


def test_serve_check_and_the_offline_llm_size_and_build_one_engine():
    """splash-serve, --check and LLM take their engine from one recipe (splash.engine.build): the same config gives
    the same per-layout pool, start layout, KV dtypes and scheduler settings, and --check prints that pool."""
    from splash.cli import check
    from splash.engine.llm import LLM
    from splash.layouts.layout import LAYOUT_NAMES as LAYOUTS
    from splash.layouts.ownership import distinct_kv_tokens
    from splash.server.startup import build_engine, engine_args

    cfg = apply_overrides(ServeConfig(), {"kv_cache_memory_bytes": 1 << 20, "world_size": 2, "block_size": 8,
                                          "layout_kv_dtypes": {"dop": "int8"}, "enable_prefix_caching": False,
                                          "max_num_seqs": 7, "allowed_layouts": ["tp", "dp_attn", "dop"]})
    served = build_engine(cfg, _TwoRanks(), _TwoRanks())
    offline = LLM(comm=_TwoRanks(), **dataclasses.asdict(engine_args(cfg))).engine
    caps = {lay: served.ledger.cap(lay) for lay in LAYOUTS}
    assert caps["dop"] == caps["tp"] > caps["dp_attn"] > 0   # replicated projections take KV room
    for e in (served, offline):
        assert {lay: e.ledger.cap(lay) for lay in LAYOUTS} == caps
        assert (e.layout, e.max_model_len, e.ledger.prefix, e.scheduler.max_num_seqs) == ("tp", caps["dp_attn"] * 8,
                                                                                          False, 7)
        assert e.runner.layout_kv_dtypes == {**dict.fromkeys(LAYOUTS, "float32"), "dop": "int8"}
    kv_line = next(line for line in check.report(cfg)[0] if line.startswith("KV "))
    assert kv_line.endswith(", ".join(f"{lay} {distinct_kv_tokens(lay, served.ledger.cap(lay), 8, 2):,}"
                                      for lay in cfg.layout.allowed_layouts))


def test_gpu_page_size_is_one_the_kernels_were_compiled_for():
    """On a GPU every attention kernel but the torch reference may run our Triton kernel (flashinfer and aiter fall
    back to it), compiled ahead of time (tests/test_triton_aot.py) for GPU_BLOCK_SIZES only: another page size is
    refused naming the field; unset, the page size is 64 there and 16 on cpu."""
    from splash.config.serve_config import GPU_BLOCK_SIZES
    assert GPU_BLOCK_SIZES == (64,)
    for backend, attn in (("cuda", "flashinfer"), ("cuda", "triton"), ("hip", "aiter"), ("hip", "triton")):
        with pytest.raises(ConfigError, match=r"field 'cache\.block_size' = 16: .*compiled .* 64 tokens only"):
            apply_overrides(ServeConfig(), {"backend": backend, "attention_backend": attn, "cache.block_size": 16})
        assert apply_overrides(ServeConfig(), {"backend": backend, "attention_backend": attn}).block_size == 64
    assert ServeConfig().block_size == 16 and apply_overrides(ServeConfig(), {"cache.block_size": 32}).block_size == 32
    torch_ref = {"backend": "cuda", "attention_backend": "torch", "cache.block_size": 16}
    assert apply_overrides(ServeConfig(), torch_ref).block_size == 16
    from splash.engine.llm import LLM   # the offline engine refuses the same, before touching the device
    with pytest.raises(ValueError, match=r"block_size = 16: .*64 tokens only"):
        LLM(preset="tiny-mla", block_size=16, attention_backend="triton", device="cuda:0")
