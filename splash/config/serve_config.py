"""Serving configuration: frozen dataclasses loaded from YAML, overridden by CLI flags (no torch).

A YAML file has up to six sections (``SECTIONS``; field names follow vLLM where vLLM has one). Unknown keys, wrong
types and out-of-range values are ``ConfigError``s naming the file and the field (``cache.block_size``). Every
section is a strict frozen pydantic dataclass that validates itself when built, so a config built in code is
checked like one read from a file; ``ServeConfig`` adds the cross-section checks.
"""
from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import pydantic
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError

from splash.config.yaml_loader import field_error, parse_size, read_yaml_mapping, unknown_key_error
from splash.errors import ConfigError
from splash.layouts.layout import LAYOUT_NAMES
from splash.layouts.memory import KV_DTYPES

LAYOUTS = LAYOUT_NAMES
HARDWARE_PROFILES = ("cpu", "h200", "b200", "bw1000")
BACKENDS = ("cpu", "cuda", "hip", "auto")   # auto: what the machine has (backends.detect), resolved at start
COMMUNICATORS = ("mpi", "torch")  # data plane: mpi4py, or torch.distributed (gloo on cpu, NCCL / RCCL on GPUs)
ATTENTION_BACKENDS = ("torch", "flashinfer", "aiter", "triton")
# which attention kernels each device backend can run (None = the backend's default)
_ATTENTION_FOR_BACKEND = {"cpu": ("torch", "triton"), "cuda": ("torch", "flashinfer", "triton"),
                          "hip": ("torch", "aiter", "triton"), "auto": ATTENTION_BACKENDS}
_DEFAULT_ATTENTION = {"cpu": "torch", "cuda": "flashinfer", "hip": "aiter", "auto": "torch"}
KV_CACHE_DTYPES = KV_DTYPES
Size = Annotated[int, BeforeValidator(lambda v: parse_size(v) if isinstance(v, str) else v)]   # 67108864, "64MiB"
# Page sizes our Triton MLA kernel is compiled and checked for ahead of time (splash.attention.kernels.triton_aot);
# on a GPU every attention kernel but torch may fall back to it, so the page size is one of these (first: default).
GPU_BLOCK_SIZES = (64,)
CPU_BLOCK_SIZE = 16


def gpu_block_size_error(block_size: int, attention_backend: str) -> str | None:
    """Why `block_size`-token pages cannot run on a GPU under `attention_backend`, or None when they can."""
    if attention_backend == "torch" or block_size in GPU_BLOCK_SIZES:
        return None
    return (f"on a GPU the {attention_backend!r} attention runs our Triton MLA kernel (flashinfer and aiter fall "
            f"back to it), compiled and checked ahead of time for pages of {' or '.join(map(str, GPU_BLOCK_SIZES))} "
            "tokens only")


def _section(name: str):
    """Make a config section: a strict frozen pydantic dataclass whose errors are ConfigErrors naming ``name.field``."""
    def make(cls: type) -> type:
        cls = pydantic.dataclasses.dataclass(cls, frozen=True,
                                             config=ConfigDict(strict=True, allow_inf_nan=False))
        validated = cls.__init__

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                validated(self, *args, **kwargs)
            except ValidationError as e:
                raise field_error(e, name, cls) from None

        cls.__init__ = __init__
        return cls
    return make


def choices(name: str) -> tuple[str, ...] | None:
    """The values field ``name`` allows (its Literal type), or None for a free-form field."""
    tp = SECTIONS[FIELD_SECTION[name]].__pydantic_fields__[name].annotation
    literal = next((a for a in (tp, *typing.get_args(tp)) if typing.get_origin(a) is Literal), None)
    return typing.get_args(literal) if literal is not None else None


@_section("model")
class ModelSection:
    model: str | None = None                     # HF model directory (config.json + safetensors)
    preset: str = "tiny-mla"                     # random-weight preset used when model is None
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"   # auto: float32 on cpu, else bf16
    seed: int = Field(0, ge=0)
    tokenizer: str | None = None                 # None → the model directory (or a byte tokenizer)
    chat_template: str | None = None             # a Jinja template file, or the template itself; None → the tokenizer's
    # sampling defaults for what a request leaves out: auto → the model's generation_config.json (as vLLM), vllm →
    # none (the API's own defaults), or a directory holding a generation_config.json
    generation_config: str = "auto"
    # None → max_position_embeddings; >= 2 (1 prompt + 1 output); the engine caps either at one request's pool room
    max_model_len: int | None = Field(None, ge=2)
    # quantise a BF16/FP32 checkpoint's linear weights at load: fp8 (128×128 blocks) or int8 (per channel);
    # None → keep the checkpoint as stored (FP8 / INT8 checkpoints stay quantised either way)
    quantization: Literal["fp8", "int8"] | None = None


@_section("parallel")
class ParallelSection:
    world_size: int | None = Field(None, ge=1)   # None → the number of ranks mpirun started
    backend: Literal[BACKENDS] = "cpu"
    attention_backend: Literal[ATTENTION_BACKENDS] | None = None  # None → backend default
    # tensor collectives; step plans, aborts and heartbeats stay on MPI. None → ServeConfig.communicator
    communicator: Literal[COMMUNICATORS] | None = None


@_section("layout")
class LayoutSection:
    layout: Literal[("auto",) + LAYOUTS] = "auto"   # auto: the cost model picks and switches
    allowed_layouts: tuple[Literal[LAYOUTS], ...] = Field(LAYOUTS, strict=False)   # a YAML list
    switch_mode: Literal["live", "blocking"] = "live"
    switch_margin: float = Field(0.10, ge=0.0)   # switch only when predicted >= 10% faster
    hardware_profile: str | None = None          # cpu|h200|b200|bw1000|path.yaml; None → cpu on cpu, a GPU's by name

    def __post_init__(self) -> None:
        hp = self.hardware_profile
        if hp is not None and hp not in HARDWARE_PROFILES and not _looks_like_path(hp):
            raise ConfigError(f"field 'layout.hardware_profile' = {hp!r} is not one of "
                              f"{', '.join(HARDWARE_PROFILES)} nor a path to a profile .yaml")
        if not self.allowed_layouts:
            raise ConfigError("field 'layout.allowed_layouts' must list at least one layout")
        if len(set(self.allowed_layouts)) != len(self.allowed_layouts):
            raise ConfigError(f"field 'layout.allowed_layouts' has duplicates: {list(self.allowed_layouts)}")
        if self.layout != "auto" and self.layout not in self.allowed_layouts:
            raise ConfigError(f"field 'layout.layout' = {self.layout!r} is not in layout.allowed_layouts "
                              f"{list(self.allowed_layouts)}")


@_section("cache")
class CacheSection:
    kv_cache_dtype: Literal[("auto",) + KV_CACHE_DTYPES] = "auto"
    # per-layout KV dtype overrides, e.g. {dop: fp8_e4m3}; the pool is sized in the widest (see ModelRunner)
    layout_kv_dtypes: dict[Literal[LAYOUTS], Literal[KV_CACHE_DTYPES]] | None = None
    block_size: int | None = Field(None, ge=1)   # tokens per KV page; None: 16 on cpu, GPU_BLOCK_SIZES[0] on GPUs
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0)
    kv_cache_memory_bytes: Size | None = Field(None, ge=1)  # explicit per-rank KV budget
    num_kv_blocks: int | None = Field(None, ge=1)  # overrides both budgets when set
    enable_prefix_caching: bool = True           # reuse cached KV blocks of shared prefixes (glm5_next: + KDA state)


@_section("scheduler")
class SchedulerSection:
    max_num_seqs: int = Field(256, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    enable_chunked_prefill: bool = True
    preemption_mode: Literal["recompute", "queue"] = "recompute"


@_section("server")
class ServerSection:
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)      # 0 → any free port (tests)
    admin_token: str | None = None               # required by the admin endpoints when set (see below)
    admin_token_file: str | None = None          # read the token from this file (keeps it out of `ps`)
    api_key: str | None = None                   # when set, every route but /health, /metrics, /version needs it
    served_model_name: str | None = None         # None → model dir name or preset
    quiet: bool = False
    log_decisions: bool | None = None            # the scheduler's "layout decision {json}" lines; None: unless quiet
    collective_timeout_s: float = Field(60.0, gt=0.0)  # a peer silent this long (no heartbeat) is dead or hung
    max_request_body_bytes: Size = Field(8 << 20, ge=1)  # larger bodies get 413
    read_timeout_s: float = Field(30.0, gt=0.0)  # a request's headers and body must arrive within this (408), and
    #                                              a client must take some of its answer within it (else dropped)
    max_seqs_per_request: int = Field(256, ge=1)  # prompts × n of one request (400 beyond)
    max_request_mb: float = Field(256.0, gt=0.0)  # a request's worst-case rank-0 memory / response size (400 beyond)
    max_waiting_seqs: int = Field(1024, ge=0)    # sequences queued beyond scheduler.max_num_seqs (429 beyond)
    drain_timeout_s: float = Field(10.0, ge=0.0)  # on SIGTERM: how long running requests may still finish
    # the model's tool-call / reasoning formats (vLLM's names, splash.server.agent); auto: from the model's type
    tool_call_parser: Literal["auto", "none", "glm45", "deepseek_v3", "deepseek_v31", "deepseek_v32"] = "auto"
    reasoning_parser: Literal["auto", "none", "glm45", "deepseek_r1", "deepseek_v3"] = "auto"

    def __post_init__(self) -> None:
        for name in ("admin_token", "admin_token_file", "api_key"):
            value = getattr(self, name)
            if value is not None and not value.strip():
                raise ConfigError(f"field 'server.{name}' is empty: an empty key would let anyone in; set a "
                                  f"non-empty one or leave it null")
        if self.admin_token is not None and self.admin_token_file is not None:
            raise ConfigError("fields 'server.admin_token' and 'server.admin_token_file' are both set; give one")


SECTIONS: dict[str, type] = {"model": ModelSection, "parallel": ParallelSection, "layout": LayoutSection,
                             "cache": CacheSection, "scheduler": SchedulerSection, "server": ServerSection}
# field name → section name; field names are unique across sections, so overrides may use bare names
FIELD_SECTION: dict[str, str] = {f.name: sec for sec, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
assert len(FIELD_SECTION) == sum(len(dataclasses.fields(c)) for c in SECTIONS.values()), "field names clash"


def _looks_like_path(s: str) -> bool:
    return s.endswith((".yaml", ".yml")) or os.sep in s or "/" in s


@dataclass(frozen=True)
class ServeConfig:
    model: ModelSection = field(default_factory=ModelSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    layout: LayoutSection = field(default_factory=LayoutSection)
    cache: CacheSection = field(default_factory=CacheSection)
    scheduler: SchedulerSection = field(default_factory=SchedulerSection)
    server: ServerSection = field(default_factory=ServerSection)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"section {name!r} must be a {cls.__name__}")
        backend, attn = self.parallel.backend, self.parallel.attention_backend
        if attn is not None and attn not in _ATTENTION_FOR_BACKEND[backend]:
            raise ConfigError(f"field 'parallel.attention_backend' = {attn!r} does not run on backend "
                              f"{backend!r} (choose from {', '.join(_ATTENTION_FOR_BACKEND[backend])})")
        bs = self.cache.block_size
        if bs is not None and self.parallel.backend in ("cuda", "hip"):
            error = gpu_block_size_error(bs, self.attention_backend)
            if error:
                raise ConfigError(f"field 'cache.block_size' = {bs}: {error}; set cache.block_size: "
                                  f"{GPU_BLOCK_SIZES[0]} (--block-size), or leave it unset")
        s = self.scheduler
        if s.max_num_batched_tokens < s.max_num_seqs:
            raise ConfigError(f"field 'scheduler.max_num_batched_tokens' ({s.max_num_batched_tokens}) must be "
                              f">= scheduler.max_num_seqs ({s.max_num_seqs})")
        queue = s.max_num_seqs + self.server.max_waiting_seqs
        if self.server.max_seqs_per_request > queue:
            raise ConfigError(f"field 'server.max_seqs_per_request' ({self.server.max_seqs_per_request}) must be <= "
                              f"scheduler.max_num_seqs + server.max_waiting_seqs ({queue}), or a request that "
                              "large could never be queued")
        mml = self.model.max_model_len
        if not s.enable_chunked_prefill and mml is not None and s.max_num_batched_tokens < mml:
            raise ConfigError(f"field 'scheduler.max_num_batched_tokens' ({s.max_num_batched_tokens}) must be "
                              f">= model.max_model_len ({mml}) when chunked prefill is disabled")

    # ---- resolved values (the "auto"/None defaults that depend on other fields) ----
    @property
    def compute_dtype(self) -> str:
        """'float32' or 'bfloat16': model.dtype, with auto = float32 on cpu, bfloat16 on GPUs."""
        if self.model.dtype != "auto":
            return self.model.dtype
        return "float32" if self.parallel.backend == "cpu" else "bfloat16"

    @property
    def block_size(self) -> int:
        """cache.block_size, None resolved by the backend: 16 on cpu, 64 on GPUs (GPU_BLOCK_SIZES)."""
        bs = self.cache.block_size
        return bs if bs is not None else CPU_BLOCK_SIZE if self.parallel.backend == "cpu" else GPU_BLOCK_SIZES[0]

    @property
    def kv_dtype(self) -> str:
        """cache.kv_cache_dtype with auto = the compute dtype."""
        kv = self.cache.kv_cache_dtype
        return self.compute_dtype if kv == "auto" else kv

    @property
    def communicator(self) -> str:
        """parallel.communicator; None: mpi on cpu (the engine ran slower on gloo there, docs/benchmarks.md), torch
        (NCCL / RCCL) on GPUs."""
        return self.parallel.communicator or ("mpi" if self.parallel.backend == "cpu" else "torch")

    @property
    def attention_backend(self) -> str:
        return self.parallel.attention_backend or _DEFAULT_ATTENTION[self.parallel.backend]

    @property
    def hardware_profile(self) -> str | None:
        """layout.hardware_profile; unset: cpu on the cpu backend; on GPUs splash-serve's start sets it from the
        device's name (startup.profile_from_device; an unknown GPU: None, and `auto` stays in its start layout)."""
        hp = self.layout.hardware_profile
        return "cpu" if hp is None and self.parallel.backend == "cpu" else hp

    @property
    def tokenizer_path(self) -> str | None:
        return self.model.tokenizer or self.model.model

    @property
    def model_name(self) -> str:
        """The name the API reports: served_model_name, else the model directory's name, else the preset."""
        if self.server.served_model_name:
            return self.server.served_model_name
        if self.model.model:
            return Path(self.model.model.rstrip("/\\")).name or self.model.model
        return self.model.preset


def _elsewhere(section: str | None) -> dict[str, str]:
    return {k: f"{s}.{k}" for k, s in FIELD_SECTION.items() if s != section}


def _build_section(name: str, raw: Any) -> Any:
    cls = SECTIONS[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"section {name!r} must be a mapping of fields, got {type(raw).__name__}")
    names = [f.name for f in dataclasses.fields(cls)]
    for key in raw:
        if key not in names:
            raise unknown_key_error(key, f"section {name!r}", names, _elsewhere(name))
    return cls(**raw)


def serve_config_from_dict(raw: dict[str, Any], where: str = "<config>") -> ServeConfig:
    """Build a ServeConfig from a nested mapping; every ConfigError is prefixed with ``where``."""
    try:
        for key in raw:
            if key not in SECTIONS:
                raise unknown_key_error(key, "the top level (sections)", SECTIONS, _elsewhere(None))
        return ServeConfig(**{name: _build_section(name, raw.get(name)) for name in SECTIONS})
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def load_serve_config(path: str | Path) -> ServeConfig:
    """Read a serving YAML; missing file, syntax error, bad key/type/value → ConfigError naming ``path``."""
    return serve_config_from_dict(read_yaml_mapping(path), str(path))


def _resolve_override_key(key: str) -> tuple[str, str]:
    section, _, name = key.rpartition(".")
    if name in FIELD_SECTION and (key == name or section == FIELD_SECTION[name]):   # "port" or "server.port"
        return FIELD_SECTION[name], name
    raise unknown_key_error(key, "the overridable fields", list(FIELD_SECTION), {})


def apply_overrides(cfg: ServeConfig, overrides: dict[str, Any], source: str = "overrides") -> ServeConfig:
    """``cfg`` with fields replaced (keys 'port' or 'server.port'), validated as YAML values are."""
    try:
        per_section: dict[str, dict[str, Any]] = {}
        for key, value in overrides.items():
            section, name = _resolve_override_key(key)
            per_section.setdefault(section, {})[name] = value
        replaced = {s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in per_section.items()}
        return dataclasses.replace(cfg, **replaced)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None
