"""The scheduler's switching rule (splash.costmodel.policy.choose_layout): pure properties."""
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from splash.costmodel.policy import choose_layout

L = ("tp", "dp_attn", "cp", "dop")
FREE = dict.fromkeys(L, 0.0)


def test_switches_when_it_pays():
    lay, why = choose_layout("tp", {"tp": 1.0, "dop": 0.5}, {"tp", "dop"}, 0.1, 100, {"dop": 1.0})
    assert lay == "dop" and why.startswith("switch")


def test_margin_prevents_flapping_at_a_crossover():
    # two layouts within the margin of each other: whichever runs, it stays — in both directions
    for a, b in [(1.0, 0.95), (0.95, 1.0), (1.0, 1.0)]:
        pred = {"tp": a, "dop": b}
        assert choose_layout("tp", pred, {"tp", "dop"}, 0.1, 1e9, FREE)[0] == "tp"
        assert choose_layout("dop", pred, {"tp", "dop"}, 0.1, 1e9, FREE)[0] == "dop"


def test_a_sweep_through_the_crossover_switches_once():
    cur, switches = "tp", 0
    for i in range(200):
        x = i / 199  # tp gets slower, dop faster; noise ±3% on top
        noise = 0.03 * (1 if i % 2 else -1)
        pred = {"tp": 1.0 + x + noise, "dop": 2.0 - x - noise}
        new, _ = choose_layout(cur, pred, {"tp", "dop"}, 0.1, 1e6, FREE)
        switches += new != cur
        cur = new
    assert cur == "dop" and switches == 1


def test_costly_switch_not_taken():
    pred = {"tp": 1.0, "dop": 0.5}
    lay, why = choose_layout("tp", pred, set(L), 0.1, 10, {"dop": 5.0})  # payoff 5.0, cost 5.0
    assert lay == "tp" and "switch cost" in why
    assert choose_layout("tp", pred, set(L), 0.1, 10.1, {"dop": 5.0})[0] == "dop"
    assert choose_layout("tp", pred, set(L), 0.1, 1e9, {})[0] == "tp"  # unknown cost: not taken


def test_infeasible_current_moves_to_fastest_feasible():
    pred = {"tp": 0.1, "dp_attn": 2.0, "cp": 1.5, "dop": 1.0}
    lay, why = choose_layout("tp", pred, {"cp", "dop", "dp_attn"}, 0.1, 0, {"dop": 1e9})
    assert lay == "dop" and "infeasible" in why
    assert choose_layout("tp", pred, set(), 0.1, 10, FREE)[0] == "tp"


def test_best_net_payoff_wins_over_fastest():
    pred = {"tp": 1.0, "cp": 0.5, "dop": 0.6}
    lay, _ = choose_layout("tp", pred, set(L), 0.1, 10, {"cp": 4.9, "dop": 0.0})  # cp nets 0.1, dop 4.0
    assert lay == "dop"


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(L), st.dictionaries(st.sampled_from(L), st.floats(1e-4, 10), min_size=1),
       st.sets(st.sampled_from(L)), st.floats(0, 0.5), st.floats(0, 1e4),
       st.dictionaries(st.sampled_from(L), st.floats(0, 100)))
def test_properties(cur, pred, feasible, margin, remaining, costs):
    lay, why = choose_layout(cur, pred, feasible, margin, remaining, costs)
    assert isinstance(why, str) and why
    if lay != cur:
        assert lay in feasible and lay in pred  # an infeasible layout is never chosen
        if cur in feasible and cur in pred:
            assert pred[lay] <= (1 - margin) * pred[cur]
            assert (pred[cur] - pred[lay]) * remaining > costs[lay]
            # and the rule is stable: from the new layout it does not want to go straight back
            assert choose_layout(lay, pred, feasible, margin, remaining, costs)[0] != cur or margin == 0



def test_a_lead_must_survive_the_candidates_uncertainty():
    pred, both = {"tp": 1.0, "dop": 0.85}, {"tp", "dop"}
    assert choose_layout("tp", pred, both, 0.1, 1e6, FREE)[0] == "dop"               # 15% faster: > margin
    lay, why = choose_layout("tp", pred, both, 0.1, 1e6, FREE, uncertainty={"dop": 0.25})
    assert lay == "tp" and "uncertainty" in why                                       # 0.85 x 1.28 > 0.9
    assert choose_layout("tp", {"tp": 1.0, "dop": 0.6}, both, 0.1, 1e6, FREE, uncertainty={"dop": 0.25})[0] == "dop"
    # the current layout's own uncertainty does not make it look worse
    assert choose_layout("tp", pred, both, 0.1, 1e6, FREE, uncertainty={"tp": 2.0})[0] == "dop"


def test_the_payoff_is_counted_at_the_pessimistic_prediction():
    pred, both, u = {"tp": 1.0, "dop": 0.5}, {"tp", "dop"}, {"dop": math.log(1.6)}   # dop at worst 0.8
    assert choose_layout("tp", pred, both, 0.1, 10, {"dop": 1.5}, uncertainty=u)[0] == "dop"   # 2.0 > 1.5
    lay, why = choose_layout("tp", pred, both, 0.1, 10, {"dop": 2.5}, uncertainty=u)
    assert lay == "tp" and "switch cost" in why                                       # 5.0 at the point, 2.0 at worst
