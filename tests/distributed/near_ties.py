"""Two runs that must agree up to float rounding (switch_worker's "convert" mode), compared step by step, and
the discrete choices in them that a rounding difference can flip at a near-tie: a flip there would change every
later step, so the checked run is pinned to the reference's choice where (and only where) it is a near-tie.

- DSA selections (SelectionCheck): the reference run records each query row's top-k positions and index scores;
  in the other run, each row's own selection (what its layout computed, CP's global top-k included) must be the
  reference's, except where the reference's scores put each position that differs within TIE_TOL of its top-k
  boundary (a position only here: of its k-th score; one only in the reference: of its (k+1)-th).
- MoE routing (RouteCheck): each row's experts must be the reference's, except where the experts that differ
  have reference router scores within a given tolerance of each other.
- Greedy tokens (TokenCheck, rank 0, which samples): each token must be the reference's, except where the
  reference's logits of the two tokens are within a given tolerance of each other.

Why: two runs that compute in different layouts differ in the last bits of their GEMMs, and a quantised KV
format rounds a last-bit difference to a whole quantum of a stored value now and then (fp8_e4m3 has 3 mantissa
bits). Measured on glm_sparse (2 ranks) with the dense projections' GEMMs changed to (w @ xᵀ)ᵀ: the two runs'
index scores differ by up to 7e-3 of the row's largest |score| in the int8 / bf16 spans (1e-6 with today's
GEMMs); two selections flipped in the fp8 span, 1.3e-2 and 2.9e-3 of the row's largest score past the top-k
boundary, and without the pin the logits then differ by 1.3e-1. A switch that skips the conversion, or converts
too late, moves selections 0.6-0.8 past it (and breaks the latent KV, which the logits check sees whatever the
selection). Greedy tokens: the reference's top two logits come within 6e-4 of the row's largest |logit|
(glm_sparse and moe_yarn), the order of the logit differences the quantised spans leave (4e-4 today, 1.7e-3 with
the GEMMs above). MoE routing: the reference's k-th and (k+1)-th router scores come within 7.4e-4 of the row's
largest (glm_sparse), and the two runs' router scores differ by up to 2.1e-4 today, 5.0e-4 with the GEMMs
above."""
from __future__ import annotations

import torch

import splash.attention.dsa as dsa
from splash.models.indexer import indexer_queries

TIE_TOL = 0.1  # of the row's largest |reference score|: how far across the top-k boundary a flip may reach

_select_layer = dsa.select_layer
_ROUTE: dict = {}  # the unwrapped MoE router (RouteCheck)


class TokenCheck:
    """Wrap `engine`'s sampler (rank 0); `step()` gives the index of the step being sampled. ref None: record
    this run (rows: (step, request) -> (token, logits row)); else check each token against `ref` (a reference
    TokenCheck's rows) and pin one that differs where the reference's logits of the two are within `tol` of the
    row's largest |logit| (`pinned`: what each one was; `beyond`: the flips that were not near-ties, unpinned;
    a request the reference did not sample at that step is left to the token comparison)."""

    def __init__(self, engine, step, tol: float, ref: dict | None = None):
        self.rows: dict = {}
        self.pinned: list[tuple] = []
        self.beyond: list[str] = []
        sample = engine.sampler.sample

        def checked(logits, req_ids):
            toks, lps = sample(logits, req_ids)
            for i, (req, t) in enumerate(zip(req_ids, toks)):
                key = (step(), req)
                if ref is None:
                    self.rows[key] = (t, logits[i].float().clone())
                    continue
                want, lg = ref.get(key, (None, None))
                if want is None or t == want:
                    continue
                gap, scale = float(lg[want] - lg[t]), float(lg.abs().max())
                if gap > tol * scale:  # not raised here: the engine would fail the request alone
                    self.beyond.append(f"token of {req} at step {key[0]}: {t}, the reference's {want}, whose "
                                       f"logit is {gap:.2e} higher (> {tol} x {scale:.2e})")
                    continue
                self.pinned.append((key, t, want, gap / scale))
                toks[i] = want
            return toks, lps
        engine.sampler.sample = checked


class RouteCheck:
    """Wrap the MoE router (splash.models.ffn.route; every rank routes every row of the step, in the same order in
    every layout); `step()` gives the index of the step being run. ref None: record this run (rows: (step, n-th
    route call of the step) -> (expert ids, weights, router choice scores)); else each row's experts must be the
    reference's, except where the experts that differ have reference choice scores within `tol` of the row's
    largest; that row is then pinned to the reference's experts and weights (`pinned`: what each one was)."""

    def __init__(self, step, tol: float, ref: dict | None = None):
        self.rows: dict = {}
        self.pinned: list[tuple] = []
        self.beyond: list[str] = []
        self.checked = 0
        self.calls = [None, 0]  # (step, route calls in it so far)
        import splash.models.ffn as ffn

        route = _ROUTE.setdefault("route", ffn.route)

        def checked(cfg, w, x):
            idx, weights = route(cfg, w, x)
            s = step()
            self.calls = [s, self.calls[1] + 1 if self.calls[0] == s else 0]
            key = (s, self.calls[1])
            if ref is None:  # the router's choice scores, as route computes them
                self.rows[key] = (idx.clone(), weights.clone(), (x.float() @ w.router.T).sigmoid() + w.bias)
                return idx, weights
            r_idx, r_w, r_choice = ref[key]
            self.checked += idx.shape[0]
            for i in (idx.sort(-1).values != r_idx.sort(-1).values).any(-1).nonzero().flatten().tolist():
                diff = sorted(set(idx[i].tolist()) ^ set(r_idx[i].tolist()))
                sc = r_choice[i, diff]
                spread, scale = float(sc.max() - sc.min()), float(r_choice[i].abs().max())
                if spread > tol * scale:
                    self.beyond.append(f"experts of row {i} at step {s} (route call {key[1]}): {idx[i].tolist()}, "
                                       f"the reference's {r_idx[i].tolist()} (choice spread {spread:.2e} > {tol} x "
                                       f"{scale:.2e})")
                    continue
                self.pinned.append((key, i, idx[i].tolist(), r_idx[i].tolist(), spread / scale))
                idx[i], weights[i] = r_idx[i], r_w[i]
            return idx, weights
        ffn.route = checked


def restore() -> None:
    """Unwrap the MoE router and the DSA selection again (a worker that runs several modes in one process)."""
    import splash.models.ffn as ffn
    ffn.route = _ROUTE.get("route", ffn.route)
    dsa.select_layer = _select_layer
    _SELECTION_CHECKS.clear()


_SELECTION_CHECKS: dict[int, "SelectionCheck"] = {}  # id of a runner's RankContext -> its check


class SelectionCheck:
    """Attach to `runner` (its rank context, which the DSA selection runs on); `step()` gives the index of the step being run. ref None: record this run (rows:
    (step, layer, request, q_pos) -> (selected positions, {visible position: score})); else check against
    `ref` (a reference SelectionCheck's rows) and pin near-tie flips (`pinned`: what each one was)."""

    def __init__(self, runner, step, ref: dict | None = None):
        self.step, self.ref = step, ref
        self.rows: dict = {}
        self.checked = 0
        self.pinned: list[tuple] = []
        _SELECTION_CHECKS[id(runner.ctx)] = self
        dsa.select_layer = _checked_select_layer

    def record(self, r, layer: int, meta, q_in: tuple, rows: list) -> None:
        x, qa, cos, sin = q_in
        w = r.weights.layers[layer].indexer
        q, hw = indexer_queries(w, qa, x, cos, sin)
        scores: dict[int, dict[int, float]] = {}
        for idx, _, kpos, s, vis in dsa.held_scores(r.cache, layer, meta, q, hw, w.softmax_scale):
            nq = s.shape[1]
            for j, i in enumerate(idx.tolist()):
                g, qq = divmod(j, nq)
                v = vis[g, qq]
                scores[i] = dict(zip(kpos[g][v].tolist(), s[g, qq][v].tolist()))
        for i, (req, pos, own, _) in enumerate(rows):
            self.rows[(self.step(), layer, req, pos)] = (own, scores[i])

    def check(self, layer: int, meta, sel, rows: list) -> None:
        """Each row's own selection == the reference's positions held here, up to a near-tie; then pinned."""
        pinned = False
        for i, (req, pos, own, l2p) in enumerate(rows):
            key = (self.step(), layer, req, pos)
            assert key in self.ref, f"no reference DSA selection for step {key[0]} layer {layer} {req} q_pos {pos}"
            ref_pos, scores = self.ref[key]
            want = {p for p in ref_pos if p // meta.block_size in l2p}
            self.checked += 1
            if own == want:
                continue
            far = _past_boundary(scores, len(ref_pos), own - want, want - own)
            scale = max(map(abs, scores.values()))
            assert far <= TIE_TOL * scale, (
                f"DSA selection at step {key[0]} layer {layer} {req} q_pos {pos} differs beyond a near-tie: "
                f"only here {sorted(own - want)}, only in the reference {sorted(want - own)}, reference scores "
                f"{ {p: scores.get(p) for p in sorted(own ^ want)} } ({far:.2e} across the top-k boundary > "
                f"{TIE_TOL} x {scale:.2e})")
            self.pinned.append((key, sorted(own - want), sorted(want - own), far / max(scale, 1e-30)))
            bs = meta.block_size
            slots = sorted(l2p[p // bs] * bs + p % bs for p in want)
            sel.slots[i] = 0
            sel.valid[i] = False
            sel.slots[i, :len(slots)] = torch.tensor(slots, dtype=sel.slots.dtype)
            sel.valid[i, :len(slots)] = True
            pinned = True
        if pinned:
            meta.sparse[layer] = dsa.SparseSelection(sel.slots * sel.valid, sel.valid)


def _past_boundary(scores: dict, k: int, added: set, dropped: set) -> float:
    """How far the reference's scores put a flip across its top-k boundary: for a position selected here but not
    there, its score's distance below the reference's k-th; for one the reference selected but not here, above
    its (k+1)-th (each rank judges the positions it holds: under CP a flip may span two ranks). inf when the
    reference selected every visible position (no boundary) or a position has no reference score."""
    if len(scores) <= k or any(p not in scores for p in added | dropped):
        return float("inf")
    top = sorted(scores.values(), reverse=True)
    return max([top[k - 1] - scores[p] for p in added] + [scores[p] - top[k] for p in dropped])


def _rows(r, meta, sel) -> list[tuple]:
    """Per query row of `meta`: (request, q_pos, positions its selection holds here, {logical block: page})."""
    reqs = {r.tables.row(q): q for q in r.tables.requests()}
    bs, out = meta.block_size, []
    for i in range(meta.num_rows):
        b = int(meta.row_req[i])
        row, n = int(meta.req_rows[b]), int(meta.num_pages[b])
        p2l = dict(zip(meta.pages[row, :n].tolist(), meta.logical[row, :n].tolist()))
        own = {p2l[s // bs] * bs + s % bs for s in sel.slots[i][sel.valid[i]].tolist()}
        out.append((reqs[row], int(meta.q_pos[i]), own, {lg: pg for pg, lg in p2l.items()}))
    return out


def _checked_select_layer(r, layer: int, meta, key_in: tuple, q_in: tuple, cp_comm=None) -> None:
    _select_layer(r, layer, meta, key_in, q_in, cp_comm)
    c, sel = _SELECTION_CHECKS.get(id(r)), meta.sparse.get(layer)
    if c is None or sel is None or not r.cfg.has_indexer(layer):
        return
    rows = _rows(r, meta, sel)
    if c.ref is None:
        c.record(r, layer, meta, q_in, rows)
    else:
        c.check(layer, meta, sel, rows)
