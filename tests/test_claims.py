"""Claims the README, `--help` texts and configs/*.yaml make that code can check: each test names the claim."""
from __future__ import annotations

import re
from pathlib import Path

from splash.engine.sampling import SamplingParams

README = Path(__file__).resolve().parents[1] / "README.md"


def _sampled(seed: int) -> list[list[int]]:
    from splash.distributed import SingleRankCommunicator
    from splash.engine.llm import LLM

    llm = LLM(preset="tiny-mla", comm=SingleRankCommunicator(), num_kv_blocks=32, seed=seed)
    params = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)   # no per-request seed
    return [out.token_ids for out in llm.generate([[5, 6, 7], [8, 9]], params)]


def test_the_seed_seeds_sampling_of_unseeded_requests():
    """`--seed N`: "random seed (preset weights, sampling)" (configs/cpu.yaml: "seeds the preset's weights and
    sampling"), as vLLM's --seed: the same seed samples the same tokens for requests that bring no seed."""
    assert _sampled(3) == _sampled(3)
    assert _sampled(3) != _sampled(4)


def _exported_metric_names() -> set[str]:
    """Every sample name GET /metrics renders, for a snapshot with a scheduler that has switched once."""
    from splash.server.engine_loop import EngineSnapshot
    from splash.server.metrics import Metrics

    model = {lay: {"last_predicted_s": 1e-3, "factor": 1.0, "last_measured_s": 1e-3, "median_error": 0.1}
             for lay in ("tp", "dp_attn", "cp", "dop")}
    direction = {"ratio": 1.0, "observed": 1, "last_predicted_s": 1e-3, "last_corrected_s": 1e-3,
                 "last_measured_s": 1e-3, "median_error": 0.1}
    snap = EngineSnapshot("tp", "auto", None, ("tp", "dop"), {("dop", "tp"): 1}, {"tp": 100}, 0, [0, 0], 8, 0, 0,
                          3, 5, scheduler={"model": model, "decisions": {"stay": 1},
                                           "switch_cost": {"directions": {"dop->tp": direction}}},
                          weight_bytes={0: 1, 1: 1}, prefix_cached_blocks=[0, 0])
    metrics = Metrics(lambda: snap)
    metrics.steps.inc()
    metrics.requests.labels("completions", "200").inc()
    metrics.step_time.observe(0.01)
    names = set()
    for line in metrics.render().decode().splitlines():
        name = line.split("{")[0].split(" ")[0]
        if line.startswith("splash_") and not name.endswith("_created"):
            names.add(re.sub(r"_(bucket|count|sum)$", "", name))
    return names


def test_the_readme_names_every_metric_the_server_exports_and_no_other():
    """README: `GET /metrics` and the auto paragraph list the metric names; a metric added or renamed without the
    README, or a name the README keeps after the code dropped it, fails here."""
    readme = set(re.findall(r"\bsplash_[a-z_]+[a-z]", README.read_text()))
    exported = _exported_metric_names()
    assert exported - readme == set(), "exported but not in the README"
    assert readme - exported == set(), "in the README but not exported"
