"""``splash-serve``: run under ``mpirun -n N``; rank 0 serves HTTP and drives the engine, the others follow.

Startup is agreed between ranks phase by phase (``splash.server.startup``): any error prints ``error: <message>``
once (rank 0) and every rank exits 2. SIGINT/SIGTERM on rank 0 (or mpiexec) drains and stops every rank; a
follower signalled alone says so and keeps serving. The heartbeat watchdog aborts all ranks when one dies or stops
answering; a slow step is not a fault.
"""
from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
import traceback
from contextlib import nullcontext, redirect_stdout
from typing import Sequence

from splash.cli.args import build_config, main_guard
from splash.errors import ConfigError


class _QuietExit(Exception):
    """Ranks ≠ 0 leave with status 2 after rank 0 reported the (agreed) error."""


def _load_config(argv: Sequence[str] | None, rank: int):
    with redirect_stdout(io.StringIO()) if rank else nullcontext():   # --help prints once
        return build_config(argv)


def _ignore_stop_signals(rank: int) -> None:
    """Followers are stopped by rank 0's stop message only; a signal sent to one of them is reported once."""
    told: list[bool] = []

    def on_signal(signum, _frame) -> None:
        if not told:
            told.append(True)
            os.write(2, f"splash-serve: rank {rank}: ignoring {signal.Signals(signum).name}: a follower stops on "
                        f"rank 0's word (signal rank 0 or mpiexec, which passes a signal to every rank)\n".encode())

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)


def _follow(engine, watchdog, rank: int) -> int:
    try:
        engine.follow()
    except Exception:  # noqa: BLE001 — a follower that fails mid-step would leave the others hanging
        from splash.server.watchdog import abort_job
        abort_job(f"splash-serve: rank {rank}: executing a step failed:\n{traceback.format_exc()}")
    watchdog.stop()
    return 0


def _serve(argv: Sequence[str] | None = None) -> int:
    from splash.distributed import init_dist, make_communicator
    from splash.distributed.launch import YIELD_ENV, describe_communicator, set_threads
    from splash.server import startup
    from splash.server.console import Console
    from splash.server.watchdog import StepChannel, Watchdog

    ctx = init_dist()
    comm, rank = ctx.comm, ctx.rank
    if rank != 0:
        _ignore_stop_signals(rank)
    try:
        cfg = startup.run_agreed(comm, lambda: _load_config(argv, rank))
        startup.run_agreed(comm, lambda: startup.check_parallel(cfg, ctx.world_size))
        cfg, backend = startup.run_agreed(comm, lambda: startup.resolve_backend(cfg, ctx.local_rank, ctx.local_size))
        startup.run_agreed(comm, lambda: startup.check_communicator(cfg))
        # the model's communicator (MPI or torch; the control plane stays on MPI), after every rank agreed it can run
        data_comm = startup.run_agreed(comm, lambda: make_communicator(cfg.communicator, ctx, cfg.parallel.backend))
        sock, secrets = startup.run_agreed(comm, lambda: _rank0_checks(cfg) if rank == 0 else (None, None))
        console = Console(quiet=cfg.server.quiet) if rank == 0 else None
        if console:
            console.log(f"splash-serve: tensor collectives on {describe_communicator(data_comm)}")
            if ctx.waits_yield:
                settings = ", ".join(f"{k}={os.environ[k]}" for k in YIELD_ENV)
                console.log(f"splash-serve: {ctx.local_size} ranks on {os.cpu_count()} cores here: "
                            f"waiting ranks yield their core ({settings})")
        watchdog = startup.start_watchdog(comm, Watchdog(rank, cfg.server.collective_timeout_s))
        step_comm = StepChannel(comm)
        set_threads(ctx)
        if console and getattr(backend, "name", backend) == "cpu":
            from splash import native
            console.log(f"splash-serve: CPU kernels {native.describe()}")
        engine = startup.run_agreed(comm, lambda: startup.build_engine(cfg, data_comm, step_comm, console, backend))
    except ConfigError:
        if rank != 0:
            raise _QuietExit() from None
        raise
    if rank != 0:
        return _follow(engine, watchdog, rank)
    return _serve_rank0(cfg, engine, sock, console, watchdog, ctx.world_size, secrets)


def _rank0_checks(cfg):
    from splash.server import startup
    startup.validate_model(cfg)
    secrets = {"admin_token": startup.resolve_admin_token(cfg.server, os.environ),
               "api_key": startup.resolve_api_key(cfg.server, os.environ)}
    return startup.bind_socket(cfg.server.host, cfg.server.port), secrets


def _serve_rank0(cfg, engine, sock, console, watchdog, world_size: int, secrets: dict) -> int:
    from splash.server import startup
    from splash.server.agent import resolve_parsers
    from splash.server.frontend import serve

    mcfg = engine.runner.cfg
    startup.quiet_decision_log(cfg)
    tokenizer = startup.serving_tokenizer(cfg, mcfg.vocab_size)
    tool_parser, reasoning_parser = resolve_parsers(cfg.server.tool_call_parser, cfg.server.reasoning_parser,
                                                    mcfg.model_type, tokenizer.chat_template)
    defaults = startup.sampling_defaults(cfg)
    if defaults and console:   # as vLLM says it: a request without these fields is not sampled as the API documents
        console.log("splash-serve: sampling defaults from the model's generation_config.json (--generation-config "
                    "vllm: none): " + ", ".join(f"{k}={v}" for k, v in defaults.items()))
    state_kw = dict(tokenizer=tokenizer, model_name=cfg.model_name, model_root=cfg.model.model or cfg.model.preset,
                    max_model_len=engine.max_model_len,
                    vocab_size=mcfg.vocab_size, host=cfg.server.host,
                    world_size=world_size, limits=cfg.server, **secrets, sampling_defaults=defaults,
                    tool_call_parser=tool_parser, reasoning_parser=reasoning_parser)
    title = f"splash-serve · {cfg.model_name} · {world_size} rank(s) · {cfg.server.host}:{sock.getsockname()[1]}"
    queue = cfg.scheduler.max_num_seqs + cfg.server.max_waiting_seqs   # sequences beyond it are answered 429
    return asyncio.run(serve(state_kw, engine, sock, console, watchdog, title, queue))


_guarded = main_guard(_serve)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``splash-serve`` (pyproject ``[project.scripts]``)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if "--check" in args and "--help" not in args and "-h" not in args:
        from splash.cli.check import run_check
        return main_guard(run_check)(args)
    try:
        return _guarded(argv)
    except _QuietExit:
        return 2


if __name__ == "__main__":
    sys.exit(main())
