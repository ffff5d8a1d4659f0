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
