import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from splash.layouts.layout import Layout, start_layout
from splash.layouts.ownership import (NoCapacity, assign_owners, block_holders, blocks_held, cp_block_rank,
                                      distinct_kv_tokens, head_range, kv_copies, kv_holders, num_blocks)


def test_head_range_sharded_and_replicated():
    assert head_range(128, 8, 0, Layout.TP) == range(0, 16)
    assert head_range(128, 8, 7, "dop") == range(112, 128)
    assert head_range(128, 8, 3, Layout.DP_ATTN) == range(128)
    assert head_range(128, 8, 3, Layout.CP) == range(128)
    shards = [h for r in range(4) for h in head_range(64, 4, r, Layout.DOP)]
    assert shards == list(range(64))


def test_head_range_errors():
    with pytest.raises(ValueError, match="does not divide"):
        head_range(6, 4, 0, Layout.TP)
    assert head_range(6, 4, 0, Layout.CP) == range(6)  # replicated: any world
    with pytest.raises(ValueError, match="out of range"):
        head_range(8, 4, 4, Layout.TP)


def test_cp_block_rank_round_robin():
    assert [cp_block_rank(b, 4) for b in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert cp_block_rank(5, 1) == 0
    assert "round-robin" in cp_block_rank.__doc__ and "never changes" in cp_block_rank.__doc__


def test_num_blocks():
    assert [num_blocks(t, 64) for t in (0, 1, 64, 65, 128)] == [0, 1, 1, 2, 2]


def test_kv_holders_per_layout():
    assert kv_holders(Layout.TP, 3, None, 4) == (frozenset(range(4)),) * 3
    assert kv_holders(Layout.DP_ATTN, 2, 2, 4) == (frozenset({2}),) * 2
    assert kv_holders(Layout.DOP, 2, 1, 4) == (frozenset({1}),) * 2
    assert kv_holders(Layout.CP, 6, None, 4) == tuple(frozenset({b % 4}) for b in range(6))
    assert kv_holders(Layout.CP, 0, None, 4) == ()


@pytest.mark.parametrize("owner", [None, -1, 4])
def test_kv_holders_owner_layouts_need_valid_owner(owner):
    with pytest.raises(ValueError, match="owner"):
        kv_holders(Layout.DOP, 1, owner, 4)


def test_assign_owners_least_loaded_largest_first():
    owners = assign_owners({"a": 100, "b": 300, "c": 200, "d": 50}, {}, 2, None)
    # b(300)->0, c(200)->1, a(100)->1 (200<300), d(50)->0 (300 vs 300, count 1 vs 2)
    assert owners == {"b": 0, "c": 1, "a": 1, "d": 0}


def test_assign_owners_respects_existing_and_ties():
    owners = assign_owners({"n": 10}, {"x": (0, 50), "y": (1, 50), "z": (2, 10)}, 3, None)
    assert owners == {"n": 2}
    # equal tokens: fewer requests wins, then lowest rank id
    assert assign_owners({"n": 1}, {"x": (0, 10), "y": (1, 5), "z": (1, 5)}, 2, None) == {"n": 0}
    assert assign_owners({"n": 1, "m": 1}, {}, 3, None) == {"m": 0, "n": 1}


def test_assign_owners_capacity_and_no_capacity():
    assert assign_owners({"a": 60}, {"x": (0, 10), "y": (1, 50)}, 2, 100) == {"a": 0}
    assert assign_owners({"a": 60}, {"x": (0, 50), "y": (1, 30)}, 2, 100) == {"a": 1}
    with pytest.raises(NoCapacity) as e:
        assign_owners({"big": 80}, {"x": (0, 50), "y": (1, 30)}, 2, 100)
    assert e.value.request == "big" and "big" in str(e.value)


def test_assign_owners_rounds_to_blocks():
    with pytest.raises(NoCapacity):
        assign_owners({"a": 65}, {}, 1, 100, block_size=64)  # 2 blocks = 128 tokens > 100
    assert assign_owners({"a": 64}, {}, 1, 100, block_size=64) == {"a": 0}


def test_fresh_owners_balance_and_are_deterministic():
    reqs = {f"r{i}": 1000 for i in range(8)}
    owners = assign_owners(reqs, {}, 4, None)
    assert sorted(owners.values()) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert assign_owners(dict(reversed(list(reqs.items()))), {}, 4, None) == owners


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text("abcdef", min_size=1, max_size=4), st.integers(0, 5000), max_size=24),
       st.sampled_from([1, 2, 4, 8]), st.one_of(st.none(), st.integers(0, 40000)))
def test_assign_owners_properties(reqs, world, cap):
    try:
        owners = assign_owners(reqs, {}, world, cap)
    except NoCapacity as e:
        assert cap is not None and e.request in reqs
        return
    assert set(owners) == set(reqs) and all(0 <= o < world for o in owners.values())
    loads = [sum(t for r, t in reqs.items() if owners[r] == k) for k in range(world)]
    if cap is not None:
        assert max(loads) <= cap
    else:  # greedy LPT bound: no rank exceeds the mean by more than the largest request
        assert max(loads) <= sum(reqs.values()) / world + max(reqs.values(), default=0)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(Layout)), st.integers(1, 8), st.data())
def test_closed_forms_agree_with_per_block_holders(layout, world, data):
    """`blocks_held` (closed form) and `block_holders` (one block) state `kv_holders`' rule."""
    owner = data.draw(st.integers(0, world - 1))
    b0 = data.draw(st.integers(0, 40))
    b1 = data.draw(st.integers(b0, b0 + 50))
    per_block = kv_holders(layout, b1, owner, world)
    walk = [0] * world
    for b in range(b0, b1):
        assert frozenset(block_holders(layout, b, owner, world)) == per_block[b]
        for r in per_block[b]:
            walk[r] += 1
    assert blocks_held(layout, owner, b0, b1, world) == walk


def test_capacity_counts_tp_copies_once():
    assert distinct_kv_tokens(Layout.TP, 100, 16, 4) == 1600          # every rank holds every token
    for lay in (Layout.DP_ATTN, Layout.CP, Layout.DOP):
        assert distinct_kv_tokens(lay, 100, 16, 4) == 6400
    assert [kv_copies(lay, 4) for lay in Layout] == [4, 1, 1, 1]


def test_owner_layouts_need_an_owner():
    with pytest.raises(ValueError, match="owner rank"):
        blocks_held(Layout.DOP, None, 0, 3, 2)


def test_start_layout():
    assert start_layout(["tp", "dop"], 16, 4) is Layout.TP
    assert start_layout(["tp", "cp", "dop"], 6, 4) is Layout.CP       # 4 does not divide 6 heads
    assert start_layout(["dop", "dp_attn"], 8, 4) is Layout.DOP
    assert start_layout(["dop"], 6, 4) is Layout.DOP                  # none fits: the head check names it later
    assert start_layout(["cp", "tp"], None, 3) is Layout.TP
