"""What one step asks of each rank, per stage and layout (FLOPs, bytes, collectives, ops) — counted, not timed.

The counts follow what splash/attention/*.py and splash/models/*.py execute (App. B stages: ``plan``, ``qkv_a``,
``q_b_absorb``, ``indexer``, ``attention``, ``uv_o``, ``exchange``, ``ffn``, ``ffn_all_reduce``, ``lm_head``,
``other``); which rows a layout projects and which keys it attends follow the ownership model (splash.layouts).
Pure Python, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from splash.costmodel.op_counts import EAGER, ops
from splash.layouts.layout import KV_ALL, KV_POSITION, Layout, parse_layout
from splash.models.config import ModelConfig

STAGES = ("plan", "qkv_a", "q_b_absorb", "indexer", "attention", "uv_o", "exchange", "ffn", "ffn_all_reduce",
          "lm_head", "other")

@dataclass
class Work:
    gemm_flops: float = 0.0
    weight_bytes: float = 0.0
    act_bytes: float = 0.0
    attn_flops: float = 0.0
    kv_bytes: float = 0.0
    exch: list[tuple[str, float, float]] = field(default_factory=list)  # (collective, bytes, count)
    ops: float = 0.0
    plan_blocks: float = 0.0
    plan_requests: float = 0.0
    temps: list[tuple[float, float]] = field(default_factory=list)  # large temporaries: (bytes, count)
    attn_calls: float = 0.0
    expert_ops: float = 0.0   # eager ops that run once per active expert (none with a grouped-GEMM MoE kernel)
    gemm_rows: dict = field(default_factory=dict)  # rows -> GEMM FLOPs at that row count (row-dependent rates)
    attn_merge_bytes: float = 0.0  # split-KV: running-output (max, sum, õ) traffic of multi-chunk groups
    attn_spill_bytes: float = 0.0  # split-KV: re-reads of the part of a gathered chunk beyond the cache share

    def add(self, other: "Work", times: float = 1.0) -> None:
        # spelled out, not a loop over field names: the scheduler calls this ~15 times per rank per prediction
        self.gemm_flops += times * other.gemm_flops
        self.weight_bytes += times * other.weight_bytes
        self.act_bytes += times * other.act_bytes
        self.attn_flops += times * other.attn_flops
        self.kv_bytes += times * other.kv_bytes
        self.ops += times * other.ops
        self.plan_blocks += times * other.plan_blocks
        self.plan_requests += times * other.plan_requests
        self.attn_calls += times * other.attn_calls
        self.expert_ops += times * other.expert_ops
        self.attn_merge_bytes += times * other.attn_merge_bytes
        self.attn_spill_bytes += times * other.attn_spill_bytes
        for r, f in other.gemm_rows.items():
            self.gemm_rows[r] = self.gemm_rows.get(r, 0.0) + times * f
        self.exch += [(k, b, n * times) for k, b, n in other.exch]
        self.temps += [(b, n * times) for b, n in other.temps]

    def collective(self, kind: str, nbytes: float) -> None:
        self.exch.append((kind, nbytes, 1))

    @property
    def exch_bytes(self) -> float:
        return sum(b * n for _, b, n in self.exch)

    @property
    def num_collectives(self) -> float:
        return sum(n for _, _, n in self.exch)


@dataclass(frozen=True)
class Piece:
    """One request's share of a step as the counter sees it (owner resolved)."""
    new: int
    context: int
    owner: int
    samples: bool = True

    @property
    def end(self) -> int:
        return self.context + self.new


def _gemm(w: Work, rows: float, k: int, n: float, wb: float, ab: float) -> None:
    if rows <= 0 or n <= 0:
        return
    w.gemm_flops += 2.0 * rows * k * n
    w.gemm_rows[rows] = w.gemm_rows.get(rows, 0.0) + 2.0 * rows * k * n
    w.weight_bytes += k * n * wb
    w.act_bytes += rows * (k + n) * ab


@dataclass(frozen=True)
class Shapes:
    cfg: ModelConfig
    world: int
    wb: float         # weight bytes per element
    ab: float         # activation bytes per element
    kv_tok: float     # attention KV bytes per token per layer (latent + rope + scales)
    idx_tok: float    # DSA indexer key bytes per token per layer (0 without DSA)
    bs: int
    scratch: float = 0.0  # split-KV attention kernel chunk budget (0: gather whole histories, one call)
    cp_prefill: str = "partials"  # CP prefill: "partials" (what splash/attention/cp.py runs) or "split" (below)
    cache: float = 0.0    # a rank's cache share: the part of a chunk's working set above it spills (0: none)
    prefill_attn: float = 1.0  # the profile's measured / predicted prefill attention for this layout
    row_kernel: bool = False   # the profile's attention_row_kernel: every row walks its own visible keys
    fused: bool = False        # the profile's fused_kernels: op counts of SPLASH's fused CPU kernels

    @property
    def heads_local(self) -> int:
        return self.cfg.num_attention_heads // self.world


def cp_keys_here(end: int, anchor: int, rank: int, world: int, bs: int) -> tuple[int, int]:
    """(positions < ``end``, blocks) of one request that ``rank`` holds under CP: its blocks round-robin from the
    anchor (splash.layouts.ownership.block_holders, in closed form for the per-rank hot path; tests/test_costmodel.py
    checks they agree). Only the request's last block is partial."""
    nb = -(-end // bs)
    first = (rank - anchor) % world  # first block index homed here
    blocks = nb // world + (1 if first < nb % world else 0)
    if blocks == 0:
        return 0, 0
    last_block = first + (blocks - 1) * world
    return (blocks - 1) * bs + min(bs, end - last_block * bs), blocks


def attention_work(s: Shapes, w: Work, pieces: list[tuple[Piece, int, int]], heads: int, new_here=None) -> None:
    """pieces: (piece, visible keys here, held blocks here); ``new_here[i]``: how many of piece i's new positions
    are among its keys here (default all; CP holds about 1/T of a chunk's). Decode rows pad to the most held
    blocks, unless the profile's row kernel walks each row's own keys."""
    cfg = s.cfg
    dc, dr = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    per_key = 2.0 * (2 * dc + dr) * heads
    topk = cfg.index_topk
    if s.row_kernel:
        _row_attention(s, w, pieces, per_key, new_here)
        w.ops += EAGER["attention"] - 13  # plan tensors, cache read and write, the one kernel call
        return
    dec = [(p, k, b) for p, k, b in pieces if p.new == 1]
    if dec:
        nb = max(b for _, _, b in dec)
        keys = nb * s.bs
        if topk:
            keys = min(keys, topk)
        w.attn_flops += len(dec) * keys * per_key
        w.kv_bytes += len(dec) * keys * s.kv_tok
        _group(s, w, len(dec), 1, nb, keys, heads)
    for p, k, b in pieces:
        if p.new != 1 and p.new > 0:
            keys = min(k, topk) if topk else k
            w.attn_flops += p.new * keys * per_key * s.prefill_attn
            w.kv_bytes += (k if not topk else min(k, p.new * topk)) * s.kv_tok * s.prefill_attn
            _group(s, w, 1, p.new, b, keys, heads)
    w.plan_requests += len(pieces)
    w.plan_blocks += sum(b for _, _, b in pieces)
    w.ops += EAGER["attention"] - 14  # plan tensors, cache read and write; the kernel's ops per group below


def _row_attention(s: Shapes, w: Work, pieces, per_key: float, new_here) -> None:
    """SPLASH's CPU row kernel (`mla_decode`, one call a layer): a decode row scores its request's keys here, row
    j of an n-row chunk the history plus about new_here·(j + 1)/n of the chunk's own keys; a request's keys are
    read from memory once. No padding, no chunks, no merges."""
    topk = s.cfg.index_topk
    for i, (p, k, _) in enumerate(pieces):
        if p.new <= 0:
            continue
        own = p.new if new_here is None else new_here[i]
        keys = min(k, topk) if topk else k
        seen = keys if p.new == 1 or topk else max(0.0, keys - own * (p.new - 1) / (2 * p.new))
        factor = 1.0 if p.new == 1 else s.prefill_attn
        w.attn_flops += p.new * seen * per_key * factor
        w.kv_bytes += (keys if not topk else min(k, p.new * topk)) * s.kv_tok * factor
    w.plan_requests += len(pieces)
    w.plan_blocks += sum(b for _, _, b in pieces)


def _group(s: Shapes, w: Work, reqs: int, rows: int, pages: int, keys: int, heads: int) -> None:
    """One attention group (all decode rows, or one prefill request). Gather path (scratch 0): one call with
    big temporaries. Split-KV kernel: chunks of pages bounded by the scratch budget, ≈ 18 eager ops each (the
    formulas of splash.attention.kernels.torch_mla.chunk_pages and chunk_spans)."""
    dc, dr = s.cfg.kv_lora_rank, s.cfg.qk_rope_head_dim
    if s.scratch <= 0:  # one call's big fp32 temporaries: the gathered latent and rope keys, two score tensors
        score = 8.0 * reqs * rows * heads * keys / 2
        w.temps += [(4.0 * reqs * keys * dc, 1), (4.0 * reqs * keys * dr, 1), (score, 1), (score, 1)]
        w.attn_calls += 1
        return
    per_page = s.bs * (8 * (dc + dr) + rows * (8 * heads + 1)) + 16
    chunk = max(1, min(pages, int(s.scratch // max(1, reqs * per_page))))
    chunks = -(-pages // chunk) if pages else 0
    w.ops += 14 if chunks <= 1 else 6 + 18 * chunks
    if chunks > 1:  # each chunk folds into the running (max, sum, õ): ≈ 7 passes over õ [reqs, rows×heads, d_c]
        w.attn_merge_bytes += chunks * MERGE_PASSES * reqs * rows * heads * (dc + 2) * 4.0
    if s.cache > 0 and chunks:  # the score and value GEMMs re-read the gathered chunk; past the cache, from memory
        # the kernel walks `chunks` near-equal chunks (torch_mla.chunk_spans): floor or ceil of pages / chunks
        for c, n in ((pages // chunks + 1, pages % chunks), (pages // chunks, chunks - pages % chunks)):
            ws = reqs * c * per_page
            if c and ws > s.cache:
                w.attn_spill_bytes += n * 2.0 * (1.0 - s.cache / ws) * reqs * c * s.bs * (dc + dr) * 4.0


MERGE_PASSES = 7  # acc·α (read, write), the chunk's p·V (write), their sum (read 2, write), the store (write)


def _indexer_rows(s: Shapes, w: Work, rows: float) -> None:
    """The DSA indexer's projections of ``rows`` and its eager ops (its key scoring: `_indexer_keys`)."""
    cfg = s.cfg
    if not cfg.index_topk:
        return
    q_in = cfg.q_lora_rank or cfg.hidden_size
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    _gemm(w, rows, q_in, ih * idim, s.wb, s.ab)         # wq_b
    _gemm(w, rows, cfg.hidden_size, idim + ih, s.wb, s.ab)  # wk + weights_proj
    w.ops += EAGER["indexer"]


def _indexer_keys(s: Shapes, w: Work, pieces: list[tuple[Piece, int, int]]) -> None:
    """The DSA indexer scoring each piece's visible keys here."""
    cfg = s.cfg
    if not cfg.index_topk:
        return
    ih, idim = cfg.index_n_heads, cfg.index_head_dim
    for p, k, _ in pieces:
        w.attn_flops += 2.0 * p.new * k * ih * idim
        w.kv_bytes += k * s.idx_tok


@dataclass(frozen=True)
class LayerRows:
    """What one layer's stages on a rank depend on besides the keys each row attends (attention, the indexer's
    scoring, the attention plan): row counts. Ranks and steps with equal LayerRows do the same work there."""
    n: int              # rows in the step
    q_rows: int         # rows projected here (Q-A, Q-B, W_UV, O)
    kv_rows: int        # rows whose KV is written here (KV-A)
    heads: int          # heads projected here
    attn_heads: int     # heads attended here
    idx_rows: int       # rows the indexer projects here
    mine: int           # rows of requests this rank owns
    exchange: bool      # the layout's exchange (False: CP's split prefill, which gathers histories: `_cp_split`)


def layer_rows(s: Shapes, layout: str, pieces: list[Piece],
               rank: int) -> tuple[LayerRows, list[tuple[Piece, int, int]], list | None, Work | None]:
    """One layer on ``rank``: its row counts, the pieces it attends (piece, visible keys here, held blocks here),
    how many of each piece's new positions are among its keys here (None: all) and, for CP's split prefill, its
    exchange (which depends on the pieces' histories)."""
    layout = parse_layout(layout)
    T, H = s.world, s.cfg.num_attention_heads
    N = sum(p.new for p in pieces)
    if layout.kv_ownership == KV_POSITION and s.cp_prefill == "split" and T > 1 and any(p.new > 1 for p in pieces):
        ex = Work()
        rows, held = _cp_split(s, ex, layout, pieces, rank)
        return LayerRows(N, rows, rows, H, H, rows, 0, False), held, None, ex
    # DP-attn projects only its own requests' rows (replicated weights); the others every row, for their heads
    mine = sum(p.new for p in pieces if p.owner == rank)
    q_rows = mine if layout is Layout.DP_ATTN else N
    heads = s.heads_local if layout.shards_projections else H
    kv = layout.kv_ownership
    if kv == KV_POSITION:   # a chunk's KV rows are written on their blocks' home ranks
        held = [(p, *cp_keys_here(p.end, p.owner, rank, T, s.bs)) for p in pieces]
        # a decode row's one new position is here when its block is homed here (the keys here before it: one fewer)
        new_here = [int((p.owner + p.context // s.bs) % T == rank) if p.new == 1
                    else k - cp_keys_here(p.context, p.owner, rank, T, s.bs)[0] for p, k, _ in held]
    else:
        held = [(p, p.end, -(-p.end // s.bs)) for p in pieces if kv == KV_ALL or p.owner == rank]
        new_here = None
    kv_rows = sum(new_here) if new_here is not None else (N if kv == KV_ALL else mine)
    # DOP's owner attends its rows for every head (the all-to-all brought it all heads' q̃): H, not H/T; the indexer
    # projects the rows whose keys it scores: DOP's owner selects for its own rows only (splash/attention/dop.py),
    # while its Q-A and Q-B run on every row for the local heads
    dop = layout is Layout.DOP
    return (LayerRows(N, q_rows, kv_rows, heads, H if dop else heads, kv_rows if dop else q_rows, mine, True),
            held, new_here, None)


def rows_work(s: Shapes, layout: str, r: LayerRows, moe: bool) -> dict[str, Work]:
    """Per-stage work of one layer that depends on its row counts only: all but the attention and the indexer's
    scoring (`keys_work`), and the exchange of CP's split prefill (`layer_rows`)."""
    layout = parse_layout(layout)
    cfg, T = s.cfg, s.world
    st = {k: Work() for k in STAGES}
    _attention_rows(s, st, layout, r)
    if r.exchange:
        _exchange(s, st["exchange"], layout, r.n, r.mine)
    st["ffn"] = ffn_work(s, r.n, moe)
    if T > 1:
        st["ffn_all_reduce"].collective("all_reduce", r.n * cfg.hidden_size * s.ab)
        st["ffn_all_reduce"].ops += 1
    st["other"].ops += EAGER["other"]
    st["other"].act_bytes += 6 * r.n * cfg.hidden_size * s.ab
    return st


def keys_work(s: Shapes, r: LayerRows, held: list[tuple[Piece, int, int]], new_here) -> dict[str, Work]:
    """Per-stage work of one layer that depends on the keys each row attends: the attention (its plan too) and the
    indexer's scoring."""
    st = {"attention": Work(), "indexer": Work()}
    attention_work(s, st["attention"], held, r.attn_heads, new_here)
    _indexer_keys(s, st["indexer"], held)
    return st


def rank_key(layout: str, pieces: list[Piece], rank: int):
    """What a layer's work on ``rank`` (`layer_rows`, `rows_work`, `keys_work`) depends on beyond what every rank
    sees (``pieces``): ranks with equal keys do the same work. TP: nothing (every rank projects every row for its
    heads and holds every request's KV); DP-attn and DOP: the (new, context) of the pieces the rank owns, in order;
    CP: the rank itself (it holds every request's blocks from its own offset)."""
    kv = parse_layout(layout).kv_ownership
    if kv == KV_ALL:
        return ()
    if kv == KV_POSITION:
        return rank
    return tuple((p.new, p.context) for p in pieces if p.owner == rank)


def _attention_rows(s: Shapes, st: dict[str, Work], layout: Layout, r: LayerRows) -> None:
    """Q-A / KV-A, Q-B and the W_UK absorb, the indexer's projections, W_UV and O of one layer on one rank."""
    cfg, wb, ab = s.cfg, s.wb, s.ab
    hid, dc, dr, dn, dv = (cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim,
                           cfg.v_head_dim)
    q_in = cfg.q_lora_rank or hid
    q_rows, heads = r.q_rows, r.heads
    if cfg.q_lora_rank:
        _gemm(st["qkv_a"], q_rows, hid, q_in, wb, ab)
    _gemm(st["qkv_a"], r.kv_rows, hid, dc + dr, wb, ab)
    st["qkv_a"].ops += ops(s.fused, "qkv_a", layout)
    _gemm(st["q_b_absorb"], q_rows, q_in, heads * (dn + dr), wb, ab)
    _gemm(st["q_b_absorb"], q_rows, dn, heads * dc, wb, ab)   # W_UK absorb (bmm per head)
    st["q_b_absorb"].ops += ops(s.fused, "q_b_absorb", layout)
    _indexer_rows(s, st["indexer"], r.idx_rows)
    _gemm(st["uv_o"], q_rows, dc, heads * dv, wb, ab)        # W_UV (bmm per head)
    _gemm(st["uv_o"], q_rows, heads * dv, hid, wb, ab)       # O
    st["uv_o"].ops += ops(s.fused, "uv_o", layout)


def _cp_split(s: Shapes, ex: Work, layout: Layout, pieces: list[Piece],
              rank: int) -> tuple[int, list[tuple[Piece, int, int]]]:
    """CP with ``cp_prefill="split"`` (SGLang's NSA context-parallel prefill): every prefill piece's new rows are
    split evenly over the ranks; each rank gathers the piece's whole history (latent KV and indexer keys: one
    all-gather a layer), runs the attention block for its rows only (all heads), and the outputs are all-gathered
    back to every row. Decode rows still attend by partial outputs + LSE. Adds the exchange to ``ex``; returns
    (rows projected here, held pieces)."""
    T, H, dc = s.world, s.cfg.num_attention_heads, s.cfg.kv_lora_rank
    dec = [p for p in pieces if p.new == 1]
    pre = [p for p in pieces if p.new > 1]
    mine = []  # this rank's share of each prefill piece: rows [lo, hi) of the chunk, as a Piece of its own
    for p in pre:
        lo, hi = rank * p.new // T, (rank + 1) * p.new // T
        if hi > lo:
            mine.append(Piece(hi - lo, p.context + lo, p.owner, p.samples))
    held = [(p, p.end, -(-p.end // s.bs)) for p in mine]
    held += [(p, *cp_keys_here(p.end, p.owner, rank, T, s.bs)) for p in dec]
    ex.ops += EAGER["exchange"][layout]
    ex.collective("all_gather", sum(p.end for p in pre) * (s.kv_tok + s.idx_tok))  # the pieces' histories
    ex.collective("all_gather", sum(p.new for p in pieces) * s.cfg.hidden_size * s.ab)   # outputs to all rows
    if dec:
        part = len(dec) * (H * dc * s.ab + H * 4.0)
        ex.collective("all_gather", T * part)
        ex.act_bytes += 4 * T * part
    return sum(p.new for p in mine) + len(dec), held


def _exchange(s: Shapes, w: Work, layout: Layout, N: int, n_own: int) -> None:
    cfg, T, ab = s.cfg, s.world, s.ab
    hid, dc, dr, H, Hl = cfg.hidden_size, cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_attention_heads, \
        s.heads_local
    if T == 1:
        return
    w.ops += EAGER["exchange"][layout]
    if layout is Layout.TP:
        w.collective("all_reduce", N * hid * ab)
    elif layout is Layout.DP_ATTN:
        w.collective("all_gather", N * hid * ab)
        w.act_bytes += 2 * N * hid * ab
    elif layout is Layout.CP:
        part = N * (H * dc * ab + H * 4.0)  # partial output + fp32 LSE
        w.collective("all_gather", T * part)
        w.act_bytes += 4 * T * part  # pack, logsumexp weights, weighted sum
        if cfg.index_topk:
            w.collective("all_gather", T * N * cfg.index_topk * 8.0)
    else:  # dop
        d = dc + dr
        send_q = N * Hl * d * ab
        recv_q = n_own * T * Hl * d * ab
        w.collective("all_to_all", max(send_q, recv_q))
        send_o, recv_o = n_own * T * Hl * dc * ab, N * Hl * dc * ab
        w.collective("all_to_all", max(send_o, recv_o))
        w.collective("all_reduce", N * hid * ab)
        w.act_bytes += 2 * (send_q + recv_q + send_o + recv_o)


def expected_active_experts(n_experts: int, k: int, rows: float) -> float:
    """Expected distinct experts hit by ``rows`` tokens each routing to ``k`` of ``n_experts`` (uniform)."""
    if rows <= 0 or n_experts <= 0:
        return 0.0
    return n_experts * (1.0 - (1.0 - k / n_experts) ** rows)


def ffn_work(s: Shapes, N: int, moe: bool) -> Work:
    """One FFN layer on ``N`` rows, sharded /T in every layout: a dense MLP, or router + routed + shared experts."""
    cfg, T, wb, ab = s.cfg, s.world, s.wb, s.ab
    hid, w = cfg.hidden_size, Work()
    if N <= 0:
        return w
    if not moe:
        _mlp(s, w, N, cfg.intermediate_size / T)
        return w
    mi, E, k = cfg.moe_intermediate_size / T, cfg.n_routed_experts, cfg.num_experts_per_tok
    active = expected_active_experts(E, k, N)
    w.gemm_flops += 2.0 * N * hid * E * 4  # router (fp32, replicated)
    w.weight_bytes += hid * E * 4
    tok = N * k
    w.gemm_flops += 2.0 * tok * hid * 3 * mi
    w.weight_bytes += active * 3 * hid * mi * wb
    w.act_bytes += tok * (3 * hid + 3 * mi) * ab
    w.ops += ops(s.fused, "moe_fixed")
    w.expert_ops += ops(s.fused, "moe_per_expert") * active
    if cfg.n_shared_experts:
        _mlp(s, w, N, mi * cfg.n_shared_experts)
    return w


def _mlp(s: Shapes, w: Work, N: int, inter: float) -> None:
    _gemm(w, N, s.cfg.hidden_size, 2 * inter, s.wb, s.ab)
    _gemm(w, N, int(inter), s.cfg.hidden_size, s.wb, s.ab)
    w.ops += ops(s.fused, "ffn_dense")


def step_extra(s: Shapes, pieces: list[Piece]) -> dict[str, Work]:
    """Per-step (not per-layer) work: the LM head on sampled rows, embeddings, final norm."""
    cfg = s.cfg
    out = {"lm_head": Work(), "other": Work()}
    rows = sum(1 for p in pieces if p.samples)
    _gemm(out["lm_head"], rows, cfg.hidden_size, cfg.vocab_size, s.wb, s.ab)
    out["lm_head"].ops += 4
    n = sum(p.new for p in pieces)
    out["other"].act_bytes += n * cfg.hidden_size * s.ab * 2
    out["other"].ops += 12
    return out


