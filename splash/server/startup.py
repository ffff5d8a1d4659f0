"""Starting ``splash-serve`` on every rank without ever leaving a rank behind: each phase that can fail runs under
``run_agreed`` (an all-gather of every rank's error), so a bad YAML or a missing checkpoint exits 2 on all ranks with
the message and no rank waits in a collective its peers never reach.
"""
from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Callable

from splash.config.serve_config import ServeConfig
from splash.errors import ConfigError


def run_agreed(comm: Any, fn: Callable[[], Any]) -> Any:
    """``fn()`` on this rank; a ConfigError on *every* rank if it raised on any (an exception other than
    ConfigError is reported naming the rank), so startup never deadlocks on a crash."""
    result, error = None, None
    try:
        result = fn()
    except ConfigError as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 — turned into an agreed, reported error
        error = f"rank {comm.rank}: {type(e).__name__}: {e}"
    agreed = next((e for e in comm.all_gather_obj(error) if e), None)   # the first rank's error, on every rank
    if agreed is not None:
        raise ConfigError(agreed)
    return result


def check_parallel(cfg: ServeConfig, world_size: int) -> None:
    ws = cfg.parallel.world_size
    if ws is not None and ws != world_size:
        raise ConfigError(f"field 'parallel.world_size' = {ws} but mpirun started {world_size} rank(s)")


def resolve_backend(cfg: ServeConfig, local_rank: int, local_size: int = 1) -> tuple[ServeConfig, Any]:
    """(cfg with `parallel.backend: auto` resolved, the Backend of the node's `local_rank`-th of `local_size`
    ranks); what this machine lacks is a ConfigError naming it, before any model is read."""
    import backends
    from splash.config.serve_config import apply_overrides

    backend = backends.get_backend(cfg.parallel.backend, local_rank, local_size=local_size)
    if backend.name != cfg.parallel.backend:
        cfg = apply_overrides(cfg, {"backend": backend.name}, source="parallel.backend: auto")
    try:
        backends.check_attention(backend.name, cfg.attention_backend, backend.device)
    except backends.BackendUnavailable as e:
        raise backends.BackendUnavailable(f"field 'parallel.attention_backend': {e}") from None
    return profile_from_device(cfg, backend), backend


def profile_from_device(cfg: ServeConfig, backend: Any) -> ServeConfig:
    """cfg, its layout.hardware_profile taken from the GPU's name when unset (an H200 → h200:
    splash.costmodel.profile.profile_for_device), so auto prices layouts for the part it runs on without being told."""
    if cfg.layout.hardware_profile is not None or not backend.is_gpu:
        return cfg
    import torch

    from splash.config.serve_config import apply_overrides
    from splash.costmodel.profile import profile_for_device
    name = torch.cuda.get_device_name(backend.device)
    hp = profile_for_device(name)
    return cfg if hp is None else apply_overrides(cfg, {"hardware_profile": hp}, source=f"the GPU's name ({name})")


def validate_model(cfg: ServeConfig) -> None:
    """Rank 0: the model directory has a readable config.json and safetensors, a usable tokenizer and chat
    template."""
    from splash.models.loader import CheckpointReader, load_model_config
    from splash.models.presets import preset_config

    if cfg.model.model:
        mcfg = load_model_config(cfg.model.model)
        CheckpointReader(cfg.model.model, mcfg)   # opens every safetensors header, checks the weight map
    else:
        try:
            mcfg = preset_config(cfg.model.preset)
        except ValueError as e:
            raise ConfigError(f"field 'model.preset': {e}") from None
    serving_tokenizer(cfg, mcfg.vocab_size)
    sampling_defaults(cfg)


def serving_tokenizer(cfg: ServeConfig, vocab_size: int) -> Any:
    """The tokenizer the server uses: the model's (or ``model.tokenizer``'s), with ``model.chat_template`` in place of
    its own template when set (a file, or the template itself), compiled here so a bad one fails at startup."""
    from splash.chat_template import compile_template
    from splash.tokenizer import load_tokenizer

    tok = load_tokenizer(cfg.tokenizer_path, vocab_size)
    value = cfg.model.chat_template
    if value is None:
        return tok
    if os.path.isfile(value):
        try:
            value = Path(value).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"field 'model.chat_template': cannot read {cfg.model.chat_template!r} ({e})") from None
    elif not any(c in value for c in "{}\n"):
        raise ConfigError(f"field 'model.chat_template': {value!r} is neither a file nor a template")
    try:
        compile_template(value)
    except Exception as e:  # noqa: BLE001 — jinja2's TemplateSyntaxError and whatever else compiling raises
        raise ConfigError(f"field 'model.chat_template': not a valid Jinja template ({type(e).__name__}: {e})") \
            from None
    tok.chat_template = value
    return tok


# generation_config.json keys vLLM takes as request defaults -> the request field each one fills
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def sampling_defaults(cfg: ServeConfig) -> dict[str, Any]:
    """The request defaults of ``model.generation_config``: from the model directory's (``auto``) or the named
    directory's generation_config.json, the keys vLLM reads (GENERATION_DEFAULTS), checked as a request's fields
    are; none for ``vllm``, a preset, or a model without the file. ConfigError naming the file and the key."""
    import json

    from splash.server import protocol as P

    where = cfg.model.generation_config
    if where == "vllm":
        return {}
    folder = cfg.model.model if where == "auto" else where
    if folder is None:
        return {}
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        if where == "auto":
            return {}
        raise ConfigError(f"field 'model.generation_config': {path} does not exist")
    try:
        raw = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"field 'model.generation_config': cannot read {path} ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"field 'model.generation_config': {path} is not a JSON object")
    out = {field: raw[key] for key, field in GENERATION_DEFAULTS.items() if raw.get(key) is not None}
    try:
        P.parse_request(P.CompletionRequest, {"prompt": [0], **out})
    except P.APIError as e:   # named by the file's key (max_new_tokens fills the field max_tokens)
        key = next((k for k, f in GENERATION_DEFAULTS.items() if f == e.param), e.param)
        raise ConfigError(f"{path}: {e.message.replace(repr(e.param), repr(key))}") from None
    return out


ADMIN_TOKEN_ENV = "SPLASH_ADMIN_TOKEN"


def resolve_admin_token(server: Any, environ: Any) -> str | None:
    """``server.admin_token``, else ``server.admin_token_file``, else SPLASH_ADMIN_TOKEN (the last two keep it
    out of ``ps``); an empty token is refused."""
    if server.admin_token is not None:
        return server.admin_token
    if server.admin_token_file is not None:
        try:
            token = open(server.admin_token_file, encoding="utf-8").read().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"field 'server.admin_token_file': cannot read {server.admin_token_file!r} ({e})")
        if not token:
            raise ConfigError(f"field 'server.admin_token_file': {server.admin_token_file!r} is empty")
        return token
    return _env_secret(environ, ADMIN_TOKEN_ENV)


API_KEY_ENV = "SPLASH_API_KEY"


def resolve_api_key(server: Any, environ: Any) -> str | None:
    """``server.api_key``, else SPLASH_API_KEY (out of ``ps``, as vLLM's VLLM_API_KEY); an empty key is refused."""
    return server.api_key if server.api_key is not None else _env_secret(environ, API_KEY_ENV)


def _env_secret(environ: Any, name: str) -> str | None:
    value = environ.get(name)
    if value is not None and not value.strip():
        raise ConfigError(f"environment variable {name} is set but empty; unset it or give a value")
    return value.strip() if value else None


def start_watchdog(comm: Any, watchdog: Any) -> Any:
    """Rank 0 listens (on loopback when every rank shares its host), broadcasts the address, followers connect."""
    hosts, address = comm.all_gather_obj(socket.gethostname()), None
    if comm.rank == 0:
        one_host = len(set(hosts)) == 1
        address = watchdog.serve(tuple(range(1, comm.size)), "127.0.0.1" if one_host else "0.0.0.0")
        if not one_host:
            address = (socket.gethostbyname(hosts[0]), address[1])
    address = comm.broadcast_obj(address)
    if comm.rank != 0:
        watchdog.connect(address)
    return watchdog


def quiet_decision_log(cfg: ServeConfig) -> None:
    """Silence the scheduler's decision lines unless ``server.log_decisions`` (default: not ``--quiet``)."""
    import logging
    wanted = cfg.server.log_decisions if cfg.server.log_decisions is not None else not cfg.server.quiet
    if not wanted:
        logging.getLogger("splash.layout_policy").setLevel(logging.WARNING)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bound early, so a busy port is a startup error like any other."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"field 'server.host'/'server.port': cannot listen on {host}:{port} ({e.strerror or e})")
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def device_budget(cfg: ServeConfig, mcfg: Any, world: int, device_bytes: int, in_use_bytes: int,
                  weight_bytes: float, arch: str) -> Any:
    """The per-rank device memory budget (splash.layouts.device_budget) of `cfg` on an `arch` device ("sm_90",
    "gfx942"; "" unknown), with the pool's bytes and the attention workspaces of that arch. ValueError when
    nothing is left for KV."""
    import backends
    from splash.attention.kernels import rope_fp8_pool
    from splash.layouts.device_budget import device_memory_budget
    from splash.layouts.layout import rank_attention

    a, lays = engine_args(cfg), cfg.layout.allowed_layouts
    workspaces = backends.attention_workspace_bytes(
        a.attention_backend, rank_attention(lays, mcfg.num_attention_heads, world, a.kv_dtypes()),
        min(a.max_num_seqs, a.max_num_batched_tokens), arch, (mcfg.kv_lora_rank, mcfg.qk_rope_head_dim), a.block_size)
    return device_memory_budget(mcfg, world, device_bytes, cfg.cache.gpu_memory_utilization, weight_bytes,
                                a.pool_kv_dtype(mcfg), a.block_size, a.max_num_batched_tokens, a.max_num_seqs,
                                in_use_bytes=in_use_bytes, layouts=tuple(lays), weight_quant=a.weight_quant(mcfg),
                                attention_workspace_bytes=workspaces, rope_fp8=rope_fp8_pool(a.attention_backend, arch))


def kv_budget_bytes(cfg: ServeConfig, mcfg: Any, world: int, backend: Any, weight_bytes: int) -> int | None:
    """Per-rank KV budget on a GPU when cache.kv_cache_memory_bytes is unset: the device budget from its measured
    memory (None elsewhere: the engine takes cache.kv_cache_memory_bytes or its default)."""
    info = backend.memory_info() if backend is not None else None
    if cfg.cache.kv_cache_memory_bytes or info is None:
        return None
    from splash.attention.kernels import device_arch

    free, total = info
    try:
        b = device_budget(cfg, mcfg, world, total, total - free, weight_bytes, device_arch(backend.device))
    except ValueError as e:
        raise ConfigError(f"field 'cache.gpu_memory_utilization': {e}") from None
    return b.kv_pool_bytes


def engine_args(cfg: ServeConfig, device: str = "cpu") -> Any:
    """The serving config's engine settings (splash.engine.build.EngineArgs) on `device`."""
    from splash.engine.build import EngineArgs

    m, c, s, lay = cfg.model, cfg.cache, cfg.scheduler, cfg.layout
    return EngineArgs(
        m.model, m.preset, dtype=cfg.compute_dtype, seed=m.seed, quantization=m.quantization,
        max_model_len=m.max_model_len, layout=lay.layout, allowed_layouts=tuple(lay.allowed_layouts),
        switch_mode=lay.switch_mode, switch_margin=lay.switch_margin, hardware_profile=cfg.hardware_profile,
        kv_cache_dtype=cfg.kv_dtype, layout_kv_dtypes=c.layout_kv_dtypes, block_size=cfg.block_size,
        num_kv_blocks=c.num_kv_blocks, enable_prefix_caching=c.enable_prefix_caching,
        kv_cache_memory_bytes=c.kv_cache_memory_bytes or EngineArgs.kv_cache_memory_bytes,   # its cpu default
        max_num_seqs=s.max_num_seqs, max_num_batched_tokens=s.max_num_batched_tokens,
        preemption_mode=s.preemption_mode, enable_chunked_prefill=s.enable_chunked_prefill,
        attention_backend=cfg.attention_backend, device=device)


def build_engine(cfg: ServeConfig, comm: Any, step_comm: Any, console: Any = None, backend: Any = None) -> Any:
    """This rank's Engine (splash.engine.build, the recipe of ``LLM``) on `backend`'s device (cpu without one),
    its max_model_len capped at the KV pool; a config it cannot serve is a ConfigError naming the field."""
    from splash.engine.build import BuildStep, build_engine as build

    args = engine_args(cfg, backend.device if backend is not None else "cpu")
    name = cfg.model.model or f"preset {cfg.model.preset}"
    try:
        engine = build(args, comm, step_comm, strict=True, streams=backend.streams() if backend is not None else None,
                       kv_budget=lambda mcfg: kv_budget_bytes(cfg, mcfg, comm.size, backend, args.weight_bytes),
                       loading=(lambda n: console.loading(f"loading {name}", n)) if console else None)
    except BuildStep as e:   # worded for the config's fields
        raise ConfigError({
            "model": f"field 'model.preset': {e}",
            "pool": "the KV budget (cache.kv_cache_memory_bytes) holds no KV page; raise it",
            "runner": f"cannot build layout {e.layout!r} on {comm.size} rank(s): {e}",
            "engine": f"field {'layout.hardware_profile' if 'profile' in str(e) else 'layout.allowed_layouts'!r}: {e}",
        }[e.step]) from None
    # every allowed layout must hold a request (the engine caps max_model_len at the smallest): a layout whose
    # replicated projections eat the whole budget would leave max_model_len 0 and reject every request
    tight = min(cfg.layout.allowed_layouts, key=engine.ledger.cap)
    if engine.ledger.cap(tight) * cfg.block_size < 2:
        raise ConfigError(f"field 'cache.kv_cache_memory_bytes': the KV budget holds {engine.ledger.cap(tight)} KV "
                          f"page(s) per rank in layout {tight!r} (its attention projections take the rest), so no "
                          f"request fits; raise it or remove {tight!r} from layout.allowed_layouts")
    if engine.max_model_len < 2:
        raise ConfigError(f"field 'model.max_model_len': the engine allows {engine.max_model_len} token(s) per "
                          "request (capped by the KV pool), so no request fits; raise the KV budget")
    return engine


def check_communicator(cfg: ServeConfig) -> None:
    """ConfigError naming ``parallel.communicator`` when this machine cannot run it."""
    from splash.distributed.launch import check_communicator as check
    try:
        check(cfg.communicator, cfg.parallel.backend)
    except (ValueError, RuntimeError) as e:
        raise ConfigError(f"field 'parallel.communicator' = {cfg.communicator!r}: {e}") from None
