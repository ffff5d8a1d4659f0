"""Per-request grammar state on rank 0: the token mask of structured output (xgrammar), applied by the sampler.

A request whose ``SamplingParams.grammar`` is set (compiled off the engine thread by ``splash.server.structured``)
gets one ``GrammarMatcher``; each step its allowed tokens go into one bitmask for the step's rows and xgrammar's
kernel masks the rest. A grammar can only fail its own request: a matcher that raises or rejects the sampled token
is reported in ``failed`` and the engine aborts that request alone. The state is keyed by request id only, so a
layout switch never touches it.
"""
from __future__ import annotations

from typing import Any

import torch


class GrammarRows:
    def __init__(self, vocab_size: int) -> None:
        self.vocab = vocab_size
        self.matchers: dict[str, Any] = {}
        self.failed: dict[str, Exception] = {}   # req_id -> why its grammar failed (this step; engine takes them)

    def add(self, req_id: str, compiled: Any, stop_ids) -> None:
        """A matcher for ``compiled`` whose end is one of ``stop_ids`` (the request's EOS and stop_token_ids)."""
        import xgrammar as xgr   # only requests with a grammar need it
        stops = sorted(int(t) for t in stop_ids if 0 <= int(t) < self.vocab)
        self.matchers[req_id] = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)

    def remove(self, req_id: str) -> None:
        self.matchers.pop(req_id, None)
        self.failed.pop(req_id, None)

    def mask(self, x: torch.Tensor, req_ids: list[str]) -> None:
        """Set the logits of ``x`` [B, V] that row i's grammar forbids to -inf, in place."""
        rows = [i for i, r in enumerate(req_ids) if r in self.matchers and r not in self.failed]
        if not rows:
            return
        import xgrammar as xgr
        bitmask = torch.full((len(req_ids), (self.vocab + 31) // 32), -1, dtype=torch.int32)
        ok = []
        for i in rows:
            rid = req_ids[i]
            try:
                self.matchers[rid].fill_next_token_bitmask(bitmask, i)
            except Exception as e:  # noqa: BLE001 — this request's grammar is broken; the others go on
                self.failed[rid] = e
                continue
            ok.append(i)
        if ok:
            bitmask_dev = bitmask.to(x.device)
            xgr.apply_token_bitmask_inplace(x, bitmask_dev, vocab_size=min(self.vocab, x.shape[-1]), indices=ok)
            # a row whose bitmask allows no token at all would leave nothing to sample: the request's own grammar
            # reached a dead end (its language is empty past this prefix), so it is the request's error (a 400)
            live = (bitmask[ok] != 0).any(-1).tolist()
            for i in (i for i, alive in zip(ok, live) if not alive):
                self.failed[req_ids[i]] = ValueError("the request's grammar allows no next token after its output "
                                                     "so far (it admits no complete output)")

    def accept(self, req_ids: list[str], tokens: list[int]) -> None:
        """Advance each row's matcher by its sampled token (rows without a grammar, or failed, are skipped)."""
        for rid, t in zip(req_ids, tokens):
            m = self.matchers.get(rid)
            if m is None or rid in self.failed:
                continue
            try:
                if not m.accept_token(int(t)):
                    self.failed[rid] = RuntimeError(f"the grammar rejected the sampled token {t}")
            except Exception as e:  # noqa: BLE001
                self.failed[rid] = e

    def take_failed(self) -> dict[str, Exception]:
        out, self.failed = self.failed, {}
        for rid in out:
            self.matchers.pop(rid, None)
        return out

