"""Resident-request counts (splash/sim/residency.py): the pooled count the paper's §5.3 sentence uses, and why no
placement on identical owners gives it."""
import pytest

from splash.costmodel import load_profile
from splash.sim.paper import Evaluator
from splash.sim.paper_data import SETUPS
from splash.sim.presets import load_sim_model
from splash.sim.residency import owner_resident_counts, pooled_resident
from splash.sim.serving import SimSetup, capacities, concurrency


def test_pooled_resident_is_the_pool_over_one_request_capped_at_the_batch():
    assert pooled_resident(6_471_680, 513_024, 16) == 12
    assert pooled_resident(6_471_680, 513_024, 10) == 10
    assert pooled_resident(100, 513_024, 16) == 0
    with pytest.raises(ValueError, match="request_tokens"):
        pooled_resident(100, 0, 16)


def test_identical_owners_give_only_multiples_of_the_owner_count():
    """With T identical owners each holding c identical requests the group holds T·c (or the whole batch): at
    T = 8, B = 16 that is 0, 8 or 16 — never 12, whatever shrinks or grows an owner's pool."""
    assert owner_resident_counts(8, 16) == [0, 8, 16]
    assert owner_resident_counts(8, 20) == [0, 8, 16, 20]
    assert owner_resident_counts(1, 3) == [0, 1, 2, 3]
    with pytest.raises(ValueError):
        owner_resident_counts(0, 4)


@pytest.mark.parametrize("reserve_gib", [0.0, 1.0, 3.2, 8.0, 20.0])
def test_no_per_rank_accounting_places_a_count_outside_the_owner_multiples(reserve_gib):
    """Whatever a rank sets aside (a chunk's transients, a reserve, scales), DP-attn's placed count at 512K moves in
    steps of 8 while the pooled count moves one request at a time."""
    m = load_sim_model("glm-5.3")
    s = SimSetup(m, load_profile("b200"), 8, reserve_bytes=reserve_gib * (1 << 30))
    caps = capacities(s)
    tok = 512_000 + 1024
    for lay in ("dp_attn", "dop"):
        assert min(16, concurrency(s, caps, lay, tok)) in owner_resident_counts(8, 16)


def test_the_resident_probe_counts_placed_per_owner_or_pooled():
    ev = Evaluator(SETUPS["b200"])
    placed = ev.evaluate(("resident", "dp_attn", 16, 512_000, 1024))
    pooled = ev.evaluate(("resident", "dp_attn", 16, 512_000, 1024, "pooled"))
    assert placed in owner_resident_counts(8, 16)
    assert pooled == pooled_resident(ev.caps["dp_attn"].distinct_tokens, 513_024, 16)
    assert ev.evaluate(("resident", "dp_attn", 16, 512_000, 1024, "per_owner")) == placed / 8
