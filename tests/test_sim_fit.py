"""splash/sim/fit.py's inverse: the link rate a held-out hardware's published primitives imply under the B200
shares. The computation only; what it gives for H200 and the DCU is in docs/benchmarks.md."""
import pytest

from splash.costmodel.profile import load_profile
from splash.sim import fit


def test_implied_link_rate_inverts_the_per_primitive_pricing():
    link, eff, alpha, nbytes = 4e11, 0.8, 1e-5, 3e9
    seconds = alpha + nbytes / (eff * link)          # splash.costmodel.switch_cost's pricing of one primitive
    assert fit.implied_link_rate(seconds, nbytes, eff, alpha) == pytest.approx(link)
    with pytest.raises(ValueError):
        fit.implied_link_rate(alpha, nbytes, eff, alpha)


def test_b200_rates_bracket_its_own_spec_link():
    """The shares were fitted at the middle of B200's published ranges, so inverting those ranges with them brackets
    B200's datasheet link rate: low end (the range's slow end) below it, high end above, for both primitives."""
    spec = load_profile("b200").link_bytes_per_s
    for lo, hi in fit.implied_link_rates("b200").values():
        assert lo < spec < hi


def test_blocking_from_primitives():
    out = fit.blocking_from_primitives(0.012, 78, 3.8e-3, 0.3e-3)
    assert out["blocking_s"] == pytest.approx(78 * 4.1e-3)
    assert out["live_over_blocking"] == pytest.approx(0.012 / (78 * 4.1e-3))
    b = fit.paper_blocking_bound()      # wired to the paper's B200 figures (78 layers, the primitives' high ends)
    assert set(b) == {"blocking_s", "live_over_blocking", "paper_blocking_s", "paper_live_over_blocking_max"}
    assert b["blocking_s"] == pytest.approx(78 * (3.807e-3 + 0.302e-3))
