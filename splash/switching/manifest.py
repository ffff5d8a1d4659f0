"""Switch manifest planner: what each rank keeps, discards and receives on a src→dst layout switch. Pure.

Every rank builds the same manifest at a step boundary from replicated metadata (request lengths and owners), so
no rank asks another what it holds. Per state kind the action is keep / discard / all_gather / all_to_all (the
paper's table: ``weight_action``, ``kv_action``); metadata (block tables, owner map, positions) is ``rebuild``:
derived locally, never sent. DSA indexer keys move with the blocks they index. KV blocks are reused verbatim when
the KV dtype is equal (scales are per token and every layout caches the rope key rotated at its absolute
position); otherwise each layer is converted after its moves, so moved blocks travel in the source format.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from splash.layouts.layout import KV_ALL, Layout, parse_layout
from splash.layouts.memory import (kv_block_bytes, kv_bytes_per_token_layer, linear_shard_bytes, projection_recv_bytes,
                                   projection_shard_bytes)
from splash.layouts.ownership import assign_owners, head_range
from splash.models.config import ModelConfig
from splash.models.family import describe
from splash.switching.block_plan import BlockMove, CachedBlock, plan_blocks

KEEP, DISCARD, ALL_GATHER, ALL_TO_ALL, REBUILD = "keep", "discard", "all_gather", "all_to_all", "rebuild"
CONVERT = "convert"
METADATA_KINDS = ("block_table", "owner_map", "positions")


@dataclass(frozen=True)
class ReqState:
    """One live request: its KV length and owner before and after the switch (None: not owner-based / planner's)."""
    num_tokens: int
    src_owner: int | None = None
    dst_owner: int | None = None
    hashes: tuple[int, ...] = ()   # prefix hashes of its leading cached (shareable) blocks


@dataclass(frozen=True)
class StateMove:
    """KDA heads [h0, h1) of request ``req``'s per-request state (every KDA layer) travel src → dst rank."""
    req: str
    h0: int
    h1: int
    src_rank: int
    dst_rank: int


def weight_action(src: Layout | str, dst: Layout | str) -> str:
    """Projections: sharded→replicated all-gathers, replicated→sharded discards, same placement keeps."""
    src, dst = parse_layout(src), parse_layout(dst)
    if src.projections == dst.projections:
        return KEEP
    return ALL_GATHER if src.shards_projections else DISCARD


def kv_action(src: Layout | str, dst: Layout | str) -> str:
    """Latent KV: into TP all-gathers; out of TP discards; owner↔owner keeps; owner↔position all-to-all."""
    src, dst = parse_layout(src), parse_layout(dst)
    if dst.kv_ownership == KV_ALL:
        return ALL_GATHER
    if src.kv_ownership == KV_ALL:
        return DISCARD
    return KEEP if src.kv_ownership == dst.kv_ownership else ALL_TO_ALL


@dataclass(frozen=True)
class Manifest:
    """The plan of one switch; byte figures are per rank per layer unless their name says total.

    ``moves`` are sent from the source placement first; ``discard`` frees blocks only after (a rank may send a block
    it then discards, e.g. CP→DP-attn), except those it sends nowhere (``freed_at_handoff``), freed at the boundary.
    Moves are listed once per physical block and destination rank (splash.switching.block_plan); all apply to every
    layer. Prefix cache: ``attach`` re-shares hash-named blocks, ``named`` is every hash a rank names after the
    switch (``cached_kept``: the idle ones, oldest first), ``dropped`` those it forgets.
    """
    src: Layout
    dst: Layout
    world: int
    num_layers: int
    actions: tuple[tuple[str, str], ...]          # (state kind, action)
    dst_owners: tuple[tuple[str, int], ...]       # owner-based destinations only
    moves: tuple[BlockMove, ...]
    keep: tuple[tuple[tuple[str, int], ...], ...]     # per rank: (req, block) held and still needed
    discard: tuple[tuple[tuple[str, int], ...], ...]  # per rank: (req, block) held and no longer needed
    kv_block_bytes_layer: int  # one block of the widest layer (an upper bound where some skip the indexer)
    weight_recv_bytes: tuple[float, ...]
    weight_sent_bytes: tuple[float, ...]
    kv_recv_bytes: tuple[int, ...]
    kv_sent_bytes: tuple[int, ...]
    src_kv_dtype: str = "float32"
    dst_kv_dtype: str = "float32"
    dst_kv_block_bytes_layer: int = 0  # one block of one layer in the destination format
    # hybrid (glm5_next) models: per-request KDA state
    linear_heads: int = 0
    src_owners: tuple[tuple[str, int], ...] = ()
    state_moves: tuple[StateMove, ...] = ()
    state_bytes_per_head: int = 0     # one head of one request over every KDA layer
    # totals over every layer, exact per rank (KV only in layers holding paged KV; KDA state: state_recv_bytes)
    kv_recv_total: tuple[int, ...] = ()
    kv_sent_total: tuple[int, ...] = ()
    weight_recv_total: tuple[float, ...] = ()
    weight_sent_total: tuple[float, ...] = ()
    # prefix cache, per rank (see the class doc); blocks running requests reference after; distinct blocks moved
    req_hashes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    attach: tuple[tuple[tuple[str, int, int], ...], ...] = ()
    named: tuple[tuple[int, ...], ...] = ()
    cached_kept: tuple[tuple[int, ...], ...] = ()
    dropped: tuple[tuple[int, ...], ...] = ()
    dst_in_use: tuple[int, ...] = ()
    logical_blocks: int = 0
    kv_block_bytes_total: int = 0     # one block over every layer holding paged KV, as moved

    def src_heads_of(self, req: str, rank: int, held: int) -> range:
        """KDA heads of `req` that `rank` holds in the source layout (else the first `held`: its stored state's)."""
        return _state_heads(self.src, self.linear_heads, self.world, rank, dict(self.src_owners).get(req)) \
            or range(held)

    def dst_heads_of(self, req: str, rank: int) -> range | None:
        """KDA heads of `req` that `rank` holds after the switch (None: none)."""
        return _state_heads(self.dst, self.linear_heads, self.world, rank, self.owners.get(req))

    def freed_at_handoff(self, rank: int) -> tuple[tuple[str, int], ...]:
        """`rank`'s discards it sends nowhere: freed at the boundary, before the handoff step appends."""
        sent = {(mv.req, mv.block_idx) for mv in self.moves if mv.src_rank == rank and mv.h is None}
        hashed = dict(self.req_hashes)
        return tuple((q, b) for q, b in self.discard[rank] if (q, b) not in sent and b >= len(hashed.get(q, ())))

    def hashes_freed_at_handoff(self, rank: int) -> tuple[int, ...]:
        """`rank`'s dropped hash-named blocks it sends nowhere: freed at the boundary like `freed_at_handoff`."""
        sent = {mv.h for mv in self.moves if mv.src_rank == rank and mv.h is not None}
        return tuple(h for h in (self.dropped[rank] if self.dropped else ()) if h not in sent)

    @property
    def shared_moves(self) -> int:
        """Moves carrying a hash-named block running requests share (once per receiving rank)."""
        return sum(1 for mv in self.moves if mv.h is not None and mv.req != "")

    @property
    def converts_kv(self) -> bool:
        return self.src_kv_dtype != self.dst_kv_dtype

    def action(self, kind: str) -> str:
        for k, a in self.actions:
            if k == kind:
                return a
        raise KeyError(f"state kind {kind!r} not in this manifest (kinds: {[k for k, _ in self.actions]})")

    @property
    def owners(self) -> dict[str, int]:
        return dict(self.dst_owners)

    def _state_bytes(self, recv: bool) -> tuple[int, ...]:
        out = [0] * self.world
        for mv in self.state_moves:
            out[mv.dst_rank if recv else mv.src_rank] += (mv.h1 - mv.h0) * self.state_bytes_per_head
        return tuple(out)

    @property
    def state_recv_bytes(self) -> tuple[int, ...]:
        """Per-request KDA state each rank receives (hybrid models; every KDA layer)."""
        return self._state_bytes(recv=True)

    @property
    def state_sent_bytes(self) -> tuple[int, ...]:
        return self._state_bytes(recv=False)

    @property
    def total_recv_bytes(self) -> tuple[float, ...]:
        """Every byte each rank receives in the switch: projections + KV blocks + KDA state, all layers."""
        return tuple(w + k + s for w, k, s in zip(self.weight_recv_total, self.kv_recv_total, self.state_recv_bytes))

    @property
    def total_sent_bytes(self) -> tuple[float, ...]:
        return tuple(w + k + s for w, k, s in zip(self.weight_sent_total, self.kv_sent_total, self.state_sent_bytes))


def _resolve_owners(src: Layout, dst: Layout, world: int, requests: Mapping[str, ReqState],
                    block_size: int) -> dict[str, int]:
    """Destination owners (CP: anchors): given ones kept; else the source owner; else balanced placement (CP: 0)."""
    if dst == Layout.CP:
        return {r: next((o for o in (s.dst_owner, s.src_owner) if o is not None), 0) for r, s in requests.items()}
    if not dst.owner_based:
        return {}
    fixed = {r: s.dst_owner for r, s in requests.items() if s.dst_owner is not None}
    if src.owner_based:
        fixed.update({r: s.src_owner for r, s in requests.items()
                      if s.dst_owner is None and s.src_owner is not None})
    free = {r: s.num_tokens for r, s in requests.items() if r not in fixed}
    existing = {r: (o, requests[r].num_tokens) for r, o in fixed.items()}
    return {**fixed, **assign_owners(free, existing, world, None, block_size=block_size)}


def _state_heads(lay: Layout, heads: int, world: int, rank: int, owner: int | None) -> range | None:
    """KDA heads of a request that `rank` holds in `lay`: its slice where sharded, else all on the owner / anchor."""
    if lay.shards_projections:
        return head_range(heads, world, rank, lay)
    return range(heads) if owner == rank or (owner is None and rank == 0) else None


def plan_state_moves(src: Layout, dst: Layout, world: int, heads: int, requests: Mapping[str, ReqState],
                     owners: Mapping[str, int]) -> list[StateMove]:
    """Per-request KDA state: each rank gets the heads the destination gives it that it lacks, from their holder."""
    moves: list[StateMove] = []
    for req in sorted(requests):
        st = requests[req]
        if st.num_tokens == 0:
            continue
        for r in range(world):
            need = _state_heads(dst, heads, world, r, owners.get(req))
            if need is None:
                continue
            for s in range(world):
                have = _state_heads(src, heads, world, s, st.src_owner)
                if have is None or s == r:
                    continue
                lo, hi = max(need.start, have.start), min(need.stop, have.stop)
                mine = _state_heads(src, heads, world, r, st.src_owner)
                if mine is not None:  # heads r already holds are kept
                    if mine.start <= lo and hi <= mine.stop:
                        continue
                if lo < hi:
                    moves.append(StateMove(req, lo, hi, s, r))
    return moves


def _weight_bytes_per_rank(cfg: ModelConfig, src: Layout, dst: Layout, world: int, weight_bytes: float,
                           weight_quant: str | None = None) -> tuple[list[float], list[float]]:
    """Per-layer projection bytes each rank receives / sends, as stored (quantised ones with their scales)."""
    recv = [projection_recv_bytes(cfg, src, dst, world, r, weight_bytes, weight_quant) for r in range(world)]
    if weight_action(src, dst) != ALL_GATHER:
        return recv, [0.0] * world
    sent = [projection_shard_bytes(cfg, head_range(cfg.num_attention_heads, world, r, src), weight_bytes,
                                   weight_quant) * (world - 1) for r in range(world)]
    return recv, sent


def _actions(cfg: ModelConfig, src: Layout, dst: Layout, moves: list[BlockMove],
             convert: bool) -> tuple[tuple[str, str], ...]:
    kv = kv_action(src, dst)
    if kv in (KEEP, DISCARD) and moves:  # explicit re-ownership (dst_owner != src_owner) needs an exchange
        kv = ALL_TO_ALL
    acts = [("proj", weight_action(src, dst)), ("kv", kv), ("kv_format", CONVERT if convert else KEEP)]
    if cfg.index_head_dim > 0:
        acts.append(("indexer_keys", kv))
    if describe(cfg).linear is not None:  # KDA layers: projections follow Q-B/KV-B/O; state moves per request
        acts.append(("linear_proj", weight_action(src, dst)))
    acts += [(k, REBUILD) for k in METADATA_KINDS]
    return tuple(acts)


def plan_switch(src: Layout | str, dst: Layout | str, cfg: ModelConfig, world: int,
                requests: Mapping[str, ReqState], block_size: int, weight_bytes: float, kv_dtype: str, *,
                src_kv_dtype: str | None = None, dst_kv_dtype: str | None = None, weight_quant: str | None = None,
                cached: Sequence[CachedBlock] = (), cached_cap: Sequence[int] | None = None,
                move_cached: bool = False, rope_fp8: bool = False) -> Manifest:
    """Plan a src→dst switch for ``requests`` on ``world`` ranks (pure; identical on every rank).

    ``src_kv_dtype``/``dst_kv_dtype`` default to ``kv_dtype``. Prefix cache: ``cached`` lists the idle cached blocks
    (oldest first), kept by the rule of splash.switching.block_plan under ``cached_cap`` blocks per rank (None:
    unbounded), moved only when ``move_cached``.
    """
    src_kv, dst_kv = src_kv_dtype or kv_dtype, dst_kv_dtype or kv_dtype
    src, dst = parse_layout(src), parse_layout(dst)
    if src == dst:
        raise ValueError(f"switch from {src.value} to itself: nothing to plan")
    for r, s in requests.items():
        if s.num_tokens < 0:
            raise ValueError(f"request {r!r}: num_tokens must be non-negative, got {s.num_tokens}")
    for lay in (src, dst):
        if lay.shards_projections:
            head_range(cfg.num_attention_heads, world, 0, lay)  # validates world | num_heads
    owners = _resolve_owners(src, dst, world, requests, block_size)
    bp = plan_blocks(src, dst, world, requests, owners, block_size, cached, cached_cap, move_cached)
    moves, keep, discard = bp.moves, bp.keep, bp.discard
    blk = kv_bytes_per_token_layer(cfg, src_kv, rope_fp8=rope_fp8) * block_size  # moves happen before conversion
    blk_all = kv_block_bytes(cfg, src_kv, block_size, rope_fp8)                    # every layer holding paged KV
    n_recv, n_sent = [0] * world, [0] * world
    for m in moves:
        n_recv[m.dst_rank] += 1
        n_sent[m.src_rank] += 1
    w_recv, w_sent = _weight_bytes_per_rank(cfg, src, dst, world, weight_bytes, weight_quant)
    hybrid = _hybrid_fields(cfg, src, dst, world, requests, owners)
    acts = _actions(cfg, src, dst, moves, src_kv != dst_kv)
    if hybrid:
        acts += (("recurrent_state", ALL_TO_ALL if hybrid["state_moves"] else KEEP),)
    w_recv_all, w_sent_all = _weight_totals(cfg, src, dst, world, weight_bytes, weight_quant, w_recv, w_sent)
    return Manifest(src, dst, world, cfg.num_hidden_layers, acts,
                    tuple(sorted(owners.items())), tuple(moves),
                    tuple(tuple(k) for k in keep), tuple(tuple(d) for d in discard), blk,
                    tuple(w_recv), tuple(w_sent), tuple(n * blk for n in n_recv), tuple(n * blk for n in n_sent),
                    src_kv, dst_kv, kv_bytes_per_token_layer(cfg, dst_kv, rope_fp8=rope_fp8) * block_size, **hybrid,
                    kv_recv_total=tuple(n * blk_all for n in n_recv), kv_sent_total=tuple(n * blk_all for n in n_sent),
                    weight_recv_total=w_recv_all, weight_sent_total=w_sent_all,
                    req_hashes=tuple((q, tuple(s.hashes)) for q, s in sorted(requests.items()) if s.hashes),
                    attach=tuple(map(tuple, bp.attach)), named=tuple(map(tuple, bp.named)),
                    cached_kept=tuple(map(tuple, bp.cached_kept)), dropped=tuple(map(tuple, bp.dropped)),
                    dst_in_use=tuple(bp.in_use), logical_blocks=bp.logical_blocks, kv_block_bytes_total=blk_all)


def _weight_totals(cfg: ModelConfig, src: Layout, dst: Layout, world: int, weight_bytes: float,
                   weight_quant: str | None, w_recv: list[float],
                   w_sent: list[float]) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Projection bytes per rank over every layer: MLA layers', plus KDA layers' shards gathered the same way."""
    fam = describe(cfg)
    n_mla = fam.num_pool_layers
    recv, sent = [w * n_mla for w in w_recv], [w * n_mla for w in w_sent]
    kda = fam.linear
    if kda is not None and weight_action(src, dst) == ALL_GATHER:   # every rank sends its shard, receives theirs
        shard = [linear_shard_bytes(cfg, head_range(kda.heads, world, r, src), weight_bytes,
                                    weight_quant) * kda.num_layers for r in range(world)]
        recv = [w + sum(shard) - shard[r] for r, w in enumerate(recv)]
        sent = [w + shard[r] * (world - 1) for r, w in enumerate(sent)]
    return tuple(recv), tuple(sent)


def _hybrid_fields(cfg: ModelConfig, src: Layout, dst: Layout, world: int, requests: Mapping[str, ReqState],
                   owners: Mapping[str, int]) -> dict:
    kda = describe(cfg).linear
    if kda is None:
        return {}
    heads = kda.heads
    for lay in (src, dst):
        if lay.shards_projections:
            head_range(heads, world, 0, lay)  # validates world | linear_num_heads
    src_owners = tuple(sorted((r, s.src_owner) for r, s in requests.items() if s.src_owner is not None))
    return dict(linear_heads=heads, src_owners=src_owners,
                state_moves=tuple(plan_state_moves(src, dst, world, heads, requests, owners)),
                state_bytes_per_head=kda.state_bytes_per_head)
