"""Command-line flags of ``splash-serve``: each overrides one ServeConfig field (``FLAGS``; choices are the field's).
Flags default to ``argparse.SUPPRESS``, so the parsed namespace is exactly the override dict."""
from __future__ import annotations

import argparse
import functools
import sys
from typing import Any, Callable, Sequence

from splash.config.serve_config import FIELD_SECTION, LAYOUTS, ServeConfig, apply_overrides, choices, load_serve_config
from splash.errors import ConfigError

_EPILOG = """\
examples:
  # 4 CPU ranks, tiny random-weight preset, settings from the shipped config:
  mpirun -n 4 splash-serve --config configs/cpu.yaml
  # a local HF model directory with default settings, no config file:
  mpirun -n 2 splash-serve --model /models/tiny-glm --port 8001
  # a config file, with a flag overriding one of its fields:
  mpirun -n 8 splash-serve --config configs/h200.yaml --layout dp_attn --switch-mode blocking

Flags override the YAML file field by field; see configs/*.yaml for every field with comments.
Configuration errors print 'error: <message>' and exit with status 2.
"""


def layout_list(text: str) -> tuple[str, ...]:
    """An argparse type: 'tp,cp' → ('tp', 'cp'), every name a layout."""
    items = tuple(s.strip() for s in text.split(",") if s.strip())
    bad = [s for s in items if s not in LAYOUTS]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a comma-separated subset of {','.join(LAYOUTS)}")
    return items


_BOOL = argparse.BooleanOptionalAction
# (flags, field, type or action, metavar, help) — grouped by section for --help
FLAGS: list[tuple[tuple[str, ...], str, Any, str | None, str]] = [
    (("--model",), "model", str, "DIR", "HF model directory (config.json, *.safetensors, tokenizer.json)"),
    (("--preset",), "preset", str, "NAME", "random-weight preset used when no --model is given"),
    (("--dtype",), "dtype", str, None,
     "compute dtype; auto = float32 on cpu, bfloat16 on GPUs"),
    (("--seed",), "seed", int, "N", "random seed of the preset's weights and of sampling for requests without a seed"),
    (("--tokenizer",), "tokenizer", str, "DIR", "tokenizer directory if not the model directory"),
    (("--generation-config",), "generation_config", str, "auto|vllm|DIR",
     "sampling defaults for fields a request leaves out (temperature, top_p, top_k, min_p, repetition_penalty, "
     "max_tokens from max_new_tokens): auto = the model's generation_config.json, as vLLM; vllm = none; or a "
     "directory holding one"),
    (("--chat-template",), "chat_template", str, "FILE|TEMPLATE",
     "the chat template: a Jinja file, or the template itself (as vLLM's --chat-template); default: the "
     "tokenizer's (tokenizer_config.json / chat_template.jinja)"),
    (("--max-model-len",), "max_model_len", int, "N",
     "longest prompt+output in tokens (default: the model's max_position_embeddings); either is capped at the KV "
     "one request can hold in the tightest allowed layout's pool, as GET /v1/models reports"),
    (("--quantization",), "quantization", str, None,
     "quantise a BF16/FP32 checkpoint's linear weights at load (fp8: 128x128 blocks, int8: per channel); "
     "FP8/INT8 checkpoints stay quantised without it"),
    (("--backend",), "backend", str, None,
     "device backend: cpu, cuda (NVIDIA), hip (AMD/DCU) or auto (what this machine has); start fails (exit 2) "
     "naming what is missing; cuda has run on one H200 only (1 and 2 ranks), hip never on hardware (docs/backends.md)"),
    (("--attention-backend",), "attention_backend", str, None,
     "MLA attention kernel: torch (reference), triton (our paged split-KV kernel), flashinfer (cuda) or aiter "
     "(hip); default: torch on cpu, flashinfer on cuda, aiter on hip; flashinfer/aiter fall back to triton where "
     "their constraints fail (flashinfer and triton checked on one H200; aiter never on hardware; docs/backends.md)"),
    (("--communicator",), "communicator", str, None,
     "tensor collectives: mpi (mpi4py; GPU tensors through host memory, for ranks that share a GPU) or torch "
     "(torch.distributed: gloo on cpu, NCCL/RCCL on GPUs); step plans and aborts stay on MPI; default: mpi on "
     "cpu, torch on cuda/hip"),
    (("--tool-call-parser",), "tool_call_parser", str, None,
     "the model's tool-call format (vLLM's names); auto: from the model's type"),
    (("--reasoning-parser",), "reasoning_parser", str, None,
     "split <think>...</think> into reasoning_content (vLLM's names); auto: from the model's type"),
    (("--layout",), "layout", str, None, "attention layout; auto lets the cost model choose and switch while serving"),
    (("--allowed-layouts",), "allowed_layouts", layout_list, "L1,L2",
     "layouts auto may choose from and a pin (--layout, POST /v1/layout) may name, comma-separated"),
    (("--switch-mode",), "switch_mode", str, None,
     "live: per-layer transfers behind compute; blocking: move all state, then run (neither drains requests)"),
    (("--switch-margin",), "switch_margin", float, "F",
     "switch only if the new layout is predicted faster by this fraction"),
    (("--hardware-profile",), "hardware_profile", str, "NAME|PATH",
     "cost-model profile of layout auto: cpu, h200, b200, bw1000, or a profile .yaml; default: cpu on the cpu "
     "backend, on a GPU the profile its name matches (H200, B200, BW1000), else none (auto then stays in its "
     "start layout: set one)"),
    (("--kv-cache-dtype", "--kv-dtype"), "kv_cache_dtype", str, None,
     "KV cache storage dtype; auto = compute dtype"),
    (("--block-size",), "block_size", int, "N",
     "tokens per KV cache page (default: 16 on cpu, 64 on GPUs, where only 64 is allowed unless the attention "
     "backend is torch)"),
    (("--gpu-memory-utilization",), "gpu_memory_utilization", float, "F",
     "GPU backends: fraction of device memory for weights, scratch, switch headroom and the KV pool "
     "(splash.layouts.device_budget) unless --kv-cache-memory-bytes or --num-kv-blocks is set; ranks that share "
     "a GPU (more ranks than GPUs) each take an equal share of it; unused on cpu"),
    (("--kv-cache-memory-bytes",), "kv_cache_memory_bytes", str, "BYTES",
     "explicit per-rank KV cache budget, e.g. 67108864 or 64MiB (default on cpu: 64MiB; on GPUs it replaces the "
     "--gpu-memory-utilization budget)"),
    (("--num-kv-blocks",), "num_kv_blocks", int, "N", "exact number of KV pages per rank"),
    (("--enable-prefix-caching",), "enable_prefix_caching", _BOOL, None,
     "reuse the KV of full blocks a prompt shares with earlier ones (on by default; glm5_next also keeps snapshots of its KDA state at block boundaries)"),
    (("--max-num-seqs",), "max_num_seqs", int, "N", "most requests in one batch"),
    (("--max-num-batched-tokens",), "max_num_batched_tokens", int, "N", "token budget of one step"),
    (("--enable-chunked-prefill",), "enable_chunked_prefill", _BOOL, None,
     "split long prompts across steps; off: a prompt runs whole in one step (needs max_num_batched_tokens >= "
     "max_model_len)"),
    (("--preemption-mode",), "preemption_mode", str, None,
     "what happens to a request evicted for lack of KV space"),
    (("--host",), "host", str, "ADDR", "HTTP listen address (rank 0)"),
    (("--port",), "port", int, "PORT", "HTTP listen port (0 = any free port)"),
    (("--admin-token",), "admin_token", str, "TOKEN",
     "bearer token required by the admin endpoints (visible in ps: prefer --admin-token-file or the "
     "SPLASH_ADMIN_TOKEN environment variable)"),
    (("--admin-token-file",), "admin_token_file", str, "PATH", "read the admin token from this file"),
    (("--api-key",), "api_key", str, "KEY",
     "clients must send 'Authorization: Bearer KEY' on every route but /health, /metrics and /version, as with "
     "vLLM's --api-key (visible in ps: prefer the SPLASH_API_KEY environment variable or the config file)"),
    (("--served-model-name",), "served_model_name", str, "NAME", "model name reported by the API"),
    (("--quiet",), "quiet", _BOOL, None,
     "no live console dashboard: only a line each for the tensor collectives and (on cpu) the CPU kernels, the "
     "serving/stopped lines and errors"),
    (("--log-decisions",), "log_decisions", _BOOL, None,
     "write the scheduler's 'layout decision {json}' lines to stderr (default: unless --quiet)"),
    (("--collective-timeout-s",), "collective_timeout_s", float, "SECONDS",
     "abort all ranks when a rank dies or sends no heartbeat for this long (a slow step is not a fault); "
     "/health reports 'stalled' while one step runs longer"),
    (("--max-request-body-bytes",), "max_request_body_bytes", str, "BYTES",
     "larger request bodies are answered 413"),
    (("--read-timeout-s",), "read_timeout_s", float, "SECONDS",
     "a request's headers and body must arrive within this (408); a client whose answer cannot be written for "
     "this long (it is not reading) is disconnected"),
    (("--max-seqs-per-request",), "max_seqs_per_request", int, "N",
     "most sequences (prompts x n) in one request (400 beyond)"),
    (("--max-request-mb",), "max_request_mb", float, "MB",
     "a request's worst-case cost, computed before it is admitted (rank-0 memory or response size: its tokens, "
     "logprob entries x n), may be this many MB (400 naming the field beyond)"),
    (("--max-waiting-seqs",), "max_waiting_seqs", int, "N",
     "sequences that may wait beyond max_num_seqs; more are answered 429 with Retry-After"),
    (("--drain-timeout-s",), "drain_timeout_s", float, "SECONDS",
     "on SIGTERM/SIGINT, how long running requests may finish before they get an error"),
]


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so the caller decides how to report it."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ConfigError(f"{message} (see '{self.prog} --help')")


def _default_text(field_name: str) -> str:
    value = getattr(getattr(ServeConfig(), FIELD_SECTION[field_name]), field_name)
    if isinstance(value, tuple):
        value = ",".join(value)
    return "" if value is None else f" [default: {value}]"


def build_parser(prog: str = "splash-serve") -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog, epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Serve an MLA model (model_type deepseek_v3, deepseek_v32, glm_moe_dsa or glm5_next loads "
                    "today) on the ranks started by mpirun, "
                    "switching the attention layout while requests run. OpenAI-compatible HTTP API on rank 0.")
    parser.add_argument("--config", metavar="YAML", default=None,
                        help="serving config file (sections model/parallel/layout/cache/scheduler/server); "
                             "without it every field has its default")
    parser.add_argument("--check", action="store_true", default=argparse.SUPPRESS,
                        help="validate the config on this machine and print what would run (model, ranks, "
                             "layouts, backend, memory budget), then exit; run it without mpirun")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for flags, name, kind, metavar, text in FLAGS:
        section = FIELD_SECTION[name]
        group = groups.get(section) or groups.setdefault(
            section, parser.add_argument_group(f"{section} (YAML section '{section}:')"))
        kw: dict[str, Any] = {"dest": name, "default": argparse.SUPPRESS,
                              "help": (text + _default_text(name)).replace("%", "%%")}
        if kind is _BOOL:
            kw["action"] = _BOOL
        else:
            kw.update(type=kind, metavar=metavar, choices=None if kind is layout_list else choices(name))
        group.add_argument(*flags, **kw)
    return parser


def build_config(argv: Sequence[str] | None = None) -> ServeConfig:
    """Parse ``argv``: load --config if given, then apply the flags given (ConfigError for anything bad)."""
    args = vars(build_parser().parse_args(argv))
    path = args.pop("config", None)
    args.pop("check", None)
    cfg = load_serve_config(path) if path is not None else ServeConfig()
    return apply_overrides(cfg, args, source="command line") if args else cfg


def main_guard(fn: Callable[..., int | None]) -> Callable[..., int]:
    """Decorator: run ``fn``; on ConfigError print 'error: <msg>' to stderr and return 2, else fn's code."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> int:
        try:
            rc = fn(*args, **kwargs)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0 if rc is None else int(rc)

    return wrapper
