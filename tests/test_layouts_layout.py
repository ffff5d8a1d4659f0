import subprocess
import sys

import pytest

from splash.layouts.layout import Layout, parse_layout


@pytest.mark.parametrize("name,expected", [
    ("tp", Layout.TP), ("TP", Layout.TP), ("dp_attn", Layout.DP_ATTN), ("dp-attn", Layout.DP_ATTN),
    ("DP", Layout.DP_ATTN), ("Dp-Attn", Layout.DP_ATTN), ("cp", Layout.CP), ("DOP", Layout.DOP),
    (Layout.CP, Layout.CP),
])
def test_parse_layout_accepts_aliases(name, expected):
    assert parse_layout(name) is expected


@pytest.mark.parametrize("bad", ["pp", "", "tp2", None, 3])
def test_parse_layout_rejects_and_names_value_and_allowed(bad):
    with pytest.raises(ValueError) as e:
        parse_layout(bad)
    msg = str(e.value)
    assert repr(bad) in msg and "dop" in msg and "dp-attn" in msg


def test_layout_is_str_enum_with_values():
    assert [l.value for l in Layout] == ["tp", "dp_attn", "cp", "dop"]
    assert Layout.DOP == "dop"


@pytest.mark.parametrize("layout,proj,kv", [
    (Layout.TP, "sharded", "all"), (Layout.DP_ATTN, "replicated", "owner"),
    (Layout.CP, "replicated", "position"), (Layout.DOP, "sharded", "owner"),
])
def test_layout_properties(layout, proj, kv):
    assert layout.projections == proj
    assert layout.kv_ownership == kv
    assert layout.shards_projections == (proj == "sharded")
    assert layout.owner_based == (kv == "owner")


def test_importing_layouts_and_switching_does_not_import_torch():
    code = ("import sys, splash.layouts.layout, splash.layouts.ownership, splash.layouts.memory, "
            "splash.layouts.device_budget, splash.switching.manifest, splash.switching.block_plan, "
            "splash.switching.handoff_blocks; assert 'torch' not in sys.modules, 'torch imported'")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def test_a_layout_prints_as_its_name():
    """A Layout in a message or an f-string reads as the name users type ("dop"), not Layout.DOP."""
    assert str(Layout.DOP) == f"{Layout.DOP}" == "dop" and f"{Layout.DP_ATTN:>8}" == " dp_attn"
