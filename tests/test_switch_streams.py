"""Side-stream switch transfers (splash.switching.executor + backends.base): every layer's transfer is issued and
landed inside the side stream and ends with an event the compute stream waits on before that layer runs, while
the next layer's transfer is issued before the current layer computes. A recording stream object stands in for
CUDA streams on CPU; tokens are those of the run without a switch."""
from __future__ import annotations

import pytest

from backends.base import NullStreams
from splash.engine.llm import LLM
from splash.engine.sampling import SamplingParams


class RecordingStreams(NullStreams):
    def __init__(self, log):
        self.log, self.n = log, 0

    def side(self):
        log = self.log

        class _Side:
            def __enter__(self):
                log.append("side")

            def __exit__(self, *exc):
                log.append("end")
        return _Side()

    def record(self):
        self.n += 1
        self.log.append(f"record{self.n}")
        return self.n

    def wait(self, event):
        self.log.append(f"wait{event}")


def _run(switch_to, streams=None, mode="live"):
    llm = LLM(preset="tiny-mla", layout="tp", num_kv_blocks=64, block_size=4, switch_mode=mode)
    log: list[str] = []
    if streams:
        llm.runner.streams = RecordingStreams(log)
    model = llm.runner.model
    forward = model.forward

    def marked(batch, attn, before=None):   # note in the log when each layer starts computing
        def hook(i):
            if before is not None:
                before(i)
            log.append(f"layer{i}")
        return forward(batch, attn, hook)
    model.forward = marked
    eng = llm.engine
    ids = [eng.add_request(p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
           for p in ([5, 6, 7, 8, 9], [1, 2])]
    out = {i: [] for i in ids}
    step = 0
    while eng.has_work():
        if step == 2 and switch_to:
            eng.request_layout(switch_to)
        for ev in eng.step():
            out[ev.req_id].append(ev.token)
        step += 1
    eng.stop()
    return [out[i] for i in ids], log, llm


@pytest.mark.parametrize("dst", ["dp_attn", "cp"])
def test_live_switch_orders_each_layer_after_its_transfer(dst):
    base, _, _ = _run(None)
    got, log, llm = _run(dst, streams=True)
    assert got == base and llm.runner.layout == dst
    layers = llm.runner.cfg.num_hidden_layers
    first = log.index("side")
    step = log[first:first + 7 * layers + 1]
    want = ["side", "end"]                               # layer 0's transfer issued
    for i in range(layers):
        want += ["side", f"record{i + 1}", "end", f"wait{i + 1}"]   # landed + event; compute waits ...
        if i + 1 < layers:
            want += ["side", "end"]                      # ... layer i+1's transfer issued before layer i runs
        want += [f"layer{i}"]
    assert step[:len(want)] == want, step


def test_blocking_switch_lands_everything_first():
    got, log, llm = _run("dop", streams=True, mode="blocking")
    layers = llm.runner.cfg.num_hidden_layers
    first = log.index("side")
    waits = [e for e in log[first:log.index("layer0", first)] if e.startswith("wait")]
    assert len(waits) == layers                          # every layer waited on before layer 0 runs
