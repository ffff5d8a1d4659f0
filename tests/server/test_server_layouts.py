"""Live layout control on the real server (``mpiexec -n 2``): pin each layout in turn through POST /v1/layout
while streams are in flight; every stream must complete with the tokens of an unswitched run, and /metrics
must count exactly those switches. Skipped until the Engine implements ``request_layout``.

Parametrised by architecture: the tiny-mla preset (DeepSeek-V3 shapes, served from a YAML config) and tiny
DeepSeek-V3.2 and GLM-5.x DSA checkpoints written by transformers (top-k 8 below the context; GLM with a shared
indexer layer) served with ``splash-serve --model DIR``; for all, /metrics' per-layout KV capacity is the memory
model's. The reference is splash's one-rank offline engine. On v32_sparse stream 0 of the second round generates
the zero-embedding pad token (258) at position 22, where layer 0 scores every key exactly 0 (23 positions, top-k
8): the selection there is the tie rule's alone, and it is decoded under CP after the dp_attn->cp pin, so this
checks that CP breaks exact ties as one rank does (splash.models.indexer.order_keys; it failed there before).
For the suite's time the DSA checkpoints stream 24 tokens (tiny-mla 48) and each round's reference is one
offline batch of the round's prompts."""
from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_util import mpiexec_path, offline_reference, run_server, save_preset

from splash.engine.build import kv_blocks_per_layout
from splash.layouts.memory import rank_weight_bytes
from splash.models.config import load_model_config

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

pytestmark = pytest.mark.skipif(mpiexec_path() is None, reason="mpiexec not found")
TOKEN = "layout-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ORDER = ["dp_attn", "cp", "dop", "tp"]      # starting from tp: tp→dp_attn→cp→dop→tp
N_STREAMS, MAX_TOKENS = 6, 48
DSA_MAX_TOKENS = 36  # the DSA checkpoints' streams (suite time; fewer lets all six finish before the pin lands on a
#                     quiet host); v32_sparse's tie is at token 18 of stream 0


KV_BYTES = 8 << 20


@pytest.fixture(scope="module", params=["tiny-mla", "glm_sparse", "v32_sparse"])
def ckpt(request, tmp_path_factory):
    if request.param == "tiny-mla":
        return save_preset("tiny-mla", tmp_path_factory.mktemp("ckpt") / "tiny-mla")
    from hf_models import DSA_VARIANTS, make_tiny_deepseek
    return make_tiny_deepseek(tmp_path_factory.mktemp("ckpt") / request.param, **DSA_VARIANTS[request.param])


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    dsa = ckpt.name != "tiny-mla"  # the DSA checkpoint comes in through --model (CLI), the preset through YAML
    yield from run_server(tmp_path_factory.mktemp("server"), f"""
{"" if dsa else f"model: {{model: {ckpt}}}"}
layout: {{layout: tp}}
cache: {{kv_cache_memory_bytes: {KV_BYTES}}}
server: {{port: 0, quiet: true, admin_token: {TOKEN}}}
""", extra_args=("--model", str(ckpt)) if dsa else ())


def _streams_with_switch(url: str, prompts: list[list[int]], target: str, model: str,
                         max_tokens: int = MAX_TOKENS) -> tuple[list[list[int]], list[bool]]:
    """Start one streaming request per prompt; once all have tokens, pin ``target``; return their tokens and
    whether each was still running when the pin was accepted. The last stream asks for 4x ``max_tokens`` so that on a
    fast host one is surely still running when the pin lands; callers compare the first ``max_tokens`` only, so once
    the pin is accepted and it has those, the client closes it (its unchecked tail would be ~3/4 of the streaming
    time) and waits until the server has cancelled it: the next round starts on an idle server, as before."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    got: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    started = threading.Barrier(len(prompts) + 1, timeout=60)
    pinned = threading.Event()
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            long = i == len(prompts) - 1
            with client.completions.create(model=model, prompt=prompts[i], max_tokens=max_tokens * (4 if long else 1),
                                           temperature=0, stream=True,
                                           extra_body={"return_token_ids": True, "ignore_eos": True}) as stream:
                first = True
                for chunk in stream:
                    for ch in chunk.choices:
                        got[i] += ch.model_extra["token_ids"]
                    if first and got[i]:
                        first = False
                        started.wait()
                    if long and pinned.is_set() and len(got[i]) >= max_tokens:
                        break
            done[i] = True
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
            started.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    try:
        started.wait()
    except threading.BrokenBarrierError:
        for t in threads:
            t.join(30)
        raise AssertionError(f"a stream failed before the switch to {target}: {errors}") from None
    r = httpx.post(f"{url}/v1/layout", json={"layout": target}, headers=AUTH, timeout=30)
    in_flight = [not d for d in done]
    pinned.set()
    assert r.status_code == 200, r.text
    for t in threads:
        t.join(120)
    assert not errors, f"streams failed while switching to {target}: {errors}"
    deadline = time.monotonic() + 30
    while _metric(url, "splash_requests_running") or _metric(url, "splash_requests_waiting"):
        assert time.monotonic() < deadline, "the closed stream is still running on the server"
        time.sleep(0.05)
    return got, in_flight


def _metric(url: str, name: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
               for s in fam.samples if s.name == name)


def _switches(url: str) -> dict[tuple[str, str], float]:
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in fam.samples:
            if s.name == "splash_layout_switches_total":
                out[(s.labels["src"], s.labels["dst"])] = s.value
    return out


def _capacity(url: str) -> dict[str, float]:
    return {s.labels["layout"]: s.value for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
            for s in fam.samples if s.name == "splash_kv_capacity_tokens"}


def _weight_bytes(url: str) -> dict[int, float]:
    """splash_weight_bytes{rank}: what each rank's weight tensors occupy, measured by the ranks themselves."""
    return {int(s.labels["rank"]): s.value for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
            for s in fam.samples if s.name == "splash_weight_bytes"}


def test_pin_each_layout_while_streams_run(server, ckpt):
    ref = offline_reference(ckpt)
    url = server.url
    assert httpx.get(f"{url}/v1/layout").json()["layout"] == "tp"
    src, max_tokens = "tp", MAX_TOKENS if ckpt.name == "tiny-mla" else DSA_MAX_TOKENS
    for k, target in enumerate(ORDER):
        prompts = [[(7 * k + 3 * i + j) % 250 + 1 for j in range(5 + i)] for i in range(N_STREAMS)]
        want = ref.many(prompts, max_tokens)  # one batch, as served; ignore_eos is irrelevant unless EOS is sampled
        try:
            got, in_flight = _streams_with_switch(url, prompts, target, ckpt.name, max_tokens)
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- server output (tail) ---\n{server.output()[-3000:]}") from None
        assert any(in_flight), "every stream finished before the switch was requested"
        for i, (g, w) in enumerate(zip(got, want)):
            assert g[:len(w)] == w, f"{ckpt.name} stream {i} pinning {src}->{target}"
        state = httpx.get(f"{url}/v1/layout").json()
        assert state["layout"] == target and state["mode"] == "pinned"
        assert _switches(url).get((src, target)) == 1.0
        mcfg = load_model_config(ckpt)  # fp32 on cpu: the memory model's bytes for this layout, per rank
        assert _weight_bytes(url) == {r: rank_weight_bytes(mcfg, target, 2, r, 4) for r in range(2)}
        src = target
    blocks = kv_blocks_per_layout(mcfg, 2, "float32", 16, KV_BYTES, 4)
    assert _capacity(url) == {lay: n * 16 * (1 if lay == "tp" else 2) for lay, n in blocks.items()}
    sw = _switches(url)
    assert sum(sw.values()) == len(ORDER) and httpx.get(f"{url}/v1/layout").json()["switch_count"] == len(ORDER)
    r = httpx.post(f"{url}/v1/layout", json={"layout": "auto"}, headers=AUTH)
    assert r.status_code == 200 and r.json()["mode"] == "auto"
