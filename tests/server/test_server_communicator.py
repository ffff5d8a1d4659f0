"""The real server (``mpiexec -n 2``) with ``--communicator torch``: the model's and the switches' collectives on
torch.distributed (gloo here), step plans on MPI. Completions before and after a live switch (tp → dop, pinned
through POST /v1/layout) give the offline tokens."""
from __future__ import annotations

import httpx
import pytest
from server_util import ServerProc, mpiexec_path, offline_reference, save_preset, write_config


pytestmark = pytest.mark.skipif(mpiexec_path() is None, reason="mpiexec not found")
TOKEN = "comm-admin"
PROMPTS = [[1, 2, 3, 4, 5], [72, 101, 108, 108, 111, 33, 10], [10, 20, 30]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_preset("tiny-mla", tmp_path_factory.mktemp("ckpt") / "tiny-mla")


def _complete(url: str, prompts) -> list[list[int]]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": "tiny-mla", "prompt": prompts, "max_tokens": 12, "temperature": 0, "return_token_ids": True})
    assert r.status_code == 200, r.text
    return [c["token_ids"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_torch_communicator_serves_and_switches(ckpt, tmp_path):
    cfg = write_config(tmp_path / "serve.yaml", f"""
model: {{model: {ckpt}}}
layout: {{layout: tp}}
cache: {{kv_cache_memory_bytes: 8MiB}}
server: {{port: 0, quiet: true, admin_token: {TOKEN}}}
""")
    proc = ServerProc(2, "--config", cfg, "--communicator", "torch", workdir=tmp_path)
    try:
        proc.wait_ready(90)
        assert "tensor collectives on torch.distributed gloo (2 ranks" in proc.output(), proc.output()[-2000:]
        want = offline_reference(ckpt).many(PROMPTS, 12)
        assert _complete(proc.url, PROMPTS) == want
        r = httpx.post(f"{proc.url}/v1/layout", json={"layout": "dop"}, timeout=60,
                       headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200, r.text
        assert _complete(proc.url, PROMPTS) == want
        assert httpx.get(f"{proc.url}/v1/layout").json()["layout"] == "dop"
    finally:
        proc.kill()
