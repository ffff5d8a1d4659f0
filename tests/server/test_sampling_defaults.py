"""The model's sampling defaults (--generation-config auto, as vLLM: splash.server.startup.sampling_defaults) fill
the fields a request leaves out, in process on one rank."""
from __future__ import annotations

from server_util import in_process


def test_the_models_sampling_defaults_fill_what_a_request_leaves_out(engine):
    """--generation-config auto (vLLM's): with temperature 0 and max_new_tokens 3 from the model's
    generation_config.json, a request without them is greedy and 3 tokens long; one that sets them keeps its own."""
    greedy = {"prompt": [1, 2, 3], "temperature": 0, "max_tokens": 3, "ignore_eos": True, "return_token_ids": True}

    async def checks(c, _):
        bare = await c.post("/v1/completions", json={"prompt": [1, 2, 3], "ignore_eos": True, "return_token_ids": True,
                                                     "seed": 5})
        chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                          "ignore_eos": True})
        own = await c.post("/v1/completions", json={**greedy, "temperature": 1.0, "seed": 5, "max_tokens": 5})
        ref = await c.post("/v1/completions", json=greedy)
        return [r.json() for r in (bare, chat, own, ref)]

    bare, chat, own, ref = in_process(engine, checks, sampling_defaults={"temperature": 0.0, "max_tokens": 3})
    assert bare["choices"][0]["token_ids"] == ref["choices"][0]["token_ids"]
    assert chat["usage"]["completion_tokens"] == 3
    assert len(own["choices"][0]["token_ids"]) == 5 and own["choices"][0]["token_ids"][:3] != ref["choices"][0]["token_ids"]
