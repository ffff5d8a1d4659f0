"""Start the real ``splash-serve`` under ``mpiexec -n N`` for tests, and always take it down again; or serve the
app in process on a one-rank engine (``in_process``)."""
from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
_LISTEN = re.compile(r"serving \S+ on (http://[\w.\-:\[\]]+) ")


def mpiexec_path() -> str | None:
    import shutil
    return shutil.which("mpiexec", path=os.path.dirname(sys.executable)) or shutil.which("mpiexec")


def serve_cmd(nprocs: int, *args: str) -> list[str]:
    return [mpiexec_path(), "-n", str(nprocs), sys.executable, "-m", "splash.cli.serve", *map(str, args)]


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(extra or {})}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class ServerProc:
    """``mpiexec -n N python -m splash.cli.serve ARGS`` in its own process group; output goes to files."""

    def __init__(self, nprocs: int, *args: str, workdir: Path, env: dict[str, str] | None = None) -> None:
        self.out_path, self.err_path = workdir / "server.out", workdir / "server.err"
        self._out, self._err = open(self.out_path, "w"), open(self.err_path, "w")
        self.proc = subprocess.Popen(serve_cmd(nprocs, *args), cwd=REPO_ROOT, env=server_env(env),
                                     stdout=self._out, stderr=self._err, start_new_session=True)
        self.url: str | None = None

    def output(self) -> str:
        return self.out_path.read_text() + self.err_path.read_text()

    def wait_ready(self, timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            if self.url is None:
                m = _LISTEN.search(self.err_path.read_text())
                self.url = m.group(1) if m else None
            if self.url is not None:
                try:
                    if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                        return self.url
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.output()}")

    def descendants(self) -> list[int]:
        """Every live process under mpiexec (hydra puts each rank in a session of its own, so a process-group
        kill of mpiexec alone does not reach them)."""
        children: dict[int, list[int]] = {}
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d.name))
        out, todo = [], [self.proc.pid]
        while todo:
            for c in children.get(todo.pop(), []):
                out.append(c)
                todo.append(c)
        return out

    def rank_pids(self) -> dict[int, int]:
        """{rank: pid} of the ranks (read from PMI_RANK in each process's environment)."""
        out: dict[int, int] = {}
        for pid in self.descendants():
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for kv in env:
                if kv.startswith(b"PMI_RANK="):
                    out[int(kv.split(b"=", 1)[1])] = pid
        return out

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signal the whole process group (as a terminal's Ctrl-C would) and wait; returns the exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
        try:
            return self.proc.wait(timeout)
        finally:
            self.kill()

    def kill(self) -> None:
        """SIGKILL mpiexec's process group and every process under it (idempotent)."""
        pids = self.descendants()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._out.close()
        self._err.close()


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def offline_reference(ckpt: Path):
    """Greedy reference from the offline ``LLM.generate`` (one process, no MPI) on the same checkpoint.

    ``ref(prompt, max_tokens)`` -> token ids (cached); ``ref.many(prompts, max_tokens)`` -> list of them.
    """
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    from splash.engine.sampling import SamplingParams

    llm = LLM(model=str(ckpt), comm=SingleRankCommunicator())
    cache: dict = {}

    def many(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        todo = [p for p in prompts if (tuple(p), max_tokens) not in cache]
        if todo:
            outs = llm.generate([list(p) for p in todo], SamplingParams(max_tokens=max_tokens, temperature=0))
            for p, o in zip(todo, outs):
                cache[(tuple(p), max_tokens)] = o.token_ids
        return [cache[(tuple(p), max_tokens)] for p in prompts]

    def ref(prompt: list[int], max_tokens: int) -> list[int]:
        return many([prompt], max_tokens)[0]

    ref.many = many
    return ref


def run_server(work: Path, yaml_text: str, nprocs: int = 2, ready_s: float = 60, extra_args: tuple[str, ...] = ()):
    """Generator for module fixtures: write `yaml_text` as the config, start splash-serve (with `extra_args`
    after --config, e.g. ("--model", DIR)), yield the running ServerProc, kill it afterwards."""
    cfg = write_config(work / "serve.yaml", yaml_text)
    proc = ServerProc(nprocs, "--config", cfg, *extra_args, workdir=work)
    try:
        proc.wait_ready(ready_s)
        yield proc
    finally:
        proc.kill()


_POLL_HEALTH = """
import sys, threading, time, httpx
stop, worst = threading.Event(), [0.0]
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), daemon=True).start()
print("polling", flush=True)
with httpx.Client(timeout=30) as c:
    while not stop.is_set():
        t0 = time.monotonic()
        assert c.get(sys.argv[1]).status_code == 200
        worst[0] = max(worst[0], time.monotonic() - t0)
        time.sleep(0.05)
print(worst[0])
"""


class HealthPoller:
    """GET /health every 50 ms from a process of its own (so what it measures is the server, not the caller's
    threads parsing large responses); ``stop()`` returns the worst latency seen, in seconds."""

    def __init__(self, url: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _POLL_HEALTH, f"{url}/health"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout.readline().strip() == "polling"

    def stop(self) -> float:
        out, _ = self.proc.communicate("stop\n", timeout=60)
        return float(out)


def save_preset(name: str, out_dir: str | Path, seed: int = 0) -> Path:
    """Write a random-weight preset as an HF checkpoint directory (config.json + model.safetensors +
    tokenizer.json)."""
    import json

    from safetensors.torch import save_file

    from splash.models.preset_configs import PRESETS
    from splash.models.presets import preset_state_dict
    from splash.tokenizer import save_byte_tokenizer
    d = Path(out_dir)
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(PRESETS[name], indent=2))
    save_file(preset_state_dict(name, seed), str(d / "model.safetensors"))
    save_byte_tokenizer(d)
    return d


def in_process(engine, checks, max_outstanding_seqs=None, limits=None, **state_kw):
    """Run ``checks(client, loop)`` (async) against a fresh app on the one-rank ``engine`` (httpx's ASGI
    transport, no socket); its result. The app's state takes ``state_kw`` and ``server`` section ``limits``."""
    from splash.config.serve_config import ServerSection
    from splash.server.app import ServerState, create_app
    from splash.server.engine_loop import EngineLoop
    from splash.server.metrics import Metrics
    from splash.tokenizer import load_tokenizer

    state_kw = {"tokenizer": load_tokenizer(None, 320), "model_name": "tiny-mla", "max_model_len": 512,
                "vocab_size": 320, **state_kw}

    async def main():
        aio = asyncio.get_running_loop()
        holder = {}
        metrics = Metrics(lambda: holder["loop"].snapshot)
        loop = holder["loop"] = EngineLoop(engine, aio.call_soon_threadsafe, metrics,
                                           max_outstanding=max_outstanding_seqs)
        state = ServerState(loop=loop, metrics=metrics, limits=ServerSection(**(limits or {})), **state_kw)
        loop.start()
        try:
            transport = httpx.ASGITransport(app=create_app(state))
            async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
                out = await checks(c, loop)
        finally:
            await asyncio.to_thread(loop.stop)
        assert loop.error is None, loop.error
        return out
    return asyncio.run(main())
