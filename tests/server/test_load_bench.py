"""The load-test path end to end (`splash-bench load`, wrapped by scripts/load_test.py): one tiny --launch run
at mpiexec -n 2 — 2 streaming clients against the unswitched reference, one forced switch request, and every
abuse client (an abandoner, an oversized body, a probe), all sending the API key the server is launched with
(every answer would be a 401 without it) — must exit 0 with nothing failed, lost or
mismatched, the abusers answered as expected and the KV drained; the report names each of them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
from server_util import mpiexec_path

pytestmark = pytest.mark.skipif(mpiexec_path() is None, reason="mpiexec not found")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))


def test_tiny_launch_with_abuse(tmp_path, capsys):
    import load_test

    doc = tmp_path / "bench.md"
    rc = load_test.main(["--launch", "--np", "2", "--clients", "2", "--requests-per-client", "2",
                         "--max-tokens", "6", "--prompts", "2", "--switch-every", "4", "--layouts", "dp_attn,tp",
                         "--abandon", "1", "--abandon-tokens", "400", "--abandon-after", "0.3",
                         "--oversized", "1", "--probe-every", "0.3", "--drain-wait", "60",
                         "--server-args", "--layout tp", "--update-doc", str(doc), "--api-key", "load-key",
                         "--json", str(tmp_path / "load.json")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "4 ok, **0 failed, 0 lost**, 0 token mismatches" in out
    assert "abuse alongside: 1 clients abandoning" in out and "unexpected answers: 0" in out
    assert "**KV in use 0**" in out and "mpiexec status 0" in out
    assert "python scripts/load_test.py --launch" in out
    assert "## Server load test under abuse (issue 14)" in doc.read_text()
    assert (tmp_path / "load.json").exists()
