"""`splash-serve --model DIR` serves a tiny GLM-5.3-Flash (glm5_next) checkpoint on 2 ranks through the OpenAI
API: completions match the offline one-rank engine, and layouts pinned live while streams run (TP → CP → DOP
→ DP-attn) keep every stream's tokens."""
from __future__ import annotations

import httpx
import pytest
from hf_glm5_next import VARIANTS, make_tiny_glm5_next
from server_util import ServerProc, mpiexec_path
from test_server_layouts import AUTH, TOKEN, _streams_with_switch

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.skipif(mpiexec_path() is None, reason="mpiexec not found")
MAX_TOKENS = 24  # _streams_with_switch streams 48 tokens each


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_glm5_next(tmp_path_factory.mktemp("glm5") / "glm5", **VARIANTS["topk_low"])


@pytest.fixture(scope="module")
def server(ckpt, tmp_path_factory):
    proc = ServerProc(2, "--model", str(ckpt), "--port", "0", "--block-size", "4", "--admin-token", TOKEN,
                      "--quiet", "--served-model-name", "tiny-mla",  # the model name the streams ask for
                      workdir=tmp_path_factory.mktemp("server"))
    try:
        proc.wait_ready(90)
        yield proc
    finally:
        proc.kill()


def offline(ckpt):
    """Greedy tokens of the one-rank offline engine, EOS ignored (as the streams ask)."""
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM
    from splash.engine.sampling import SamplingParams

    llm = LLM(model=str(ckpt), comm=SingleRankCommunicator())
    return lambda p, n: llm.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].token_ids


def test_serves_and_switches_live(server, ckpt):
    ref = offline(ckpt)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
    prompt = [5, 17, 99, 3, 250, 41, 8]
    out = client.completions.create(model=client.models.list().data[0].id, prompt=prompt, max_tokens=MAX_TOKENS,
                                    temperature=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    assert out.choices[0].model_extra["token_ids"] == ref(prompt, MAX_TOKENS)
    for k, target in enumerate(["cp", "dop", "dp_attn"]):
        prompts = [[(11 * k + 3 * i + j) % 250 + 1 for j in range(4 + 3 * i)] for i in range(4)]
        got, in_flight = _streams_with_switch(server.url, prompts, target, "tiny-mla")
        assert any(in_flight), "every stream finished before the switch"
        for g, p in zip(got, prompts):
            w = ref(p, 48)
            assert len(g) >= len(w) and g[:len(w)] == w, (target, g, w)
        assert httpx.get(f"{server.url}/v1/layout").json()["layout"] == target
    assert httpx.post(f"{server.url}/v1/layout", json={"layout": "tp"}, headers=AUTH).status_code == 200
