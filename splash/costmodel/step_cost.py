"""Predicted time of one step per layout, and of a switch — the cost model of App. B. Pure, no torch.

Stage time on a rank = roofline max(compute, memory) of its GEMMs (or attention: max, or sum when the profile
says the kernel gathers first) + its collectives (α + bytes/β each) + eager ops × per-op overhead. Stages of a
layer depend on each other and add; the layer's exchanges may hide behind attention only up to the profile's
``overlap_fraction`` of the attention time. Ranks meet at every layer's collectives, so the busiest rank sets
the step; a step with collectives also waits for the slower peer, ``collective_wait_fraction`` of the rank's time
outside them (stage ``sync``).
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from splash.costmodel.profile import HardwareProfile
from splash.costmodel.switch_cost import (blocking_seconds, cached_recv_bytes, kv_bytes_per_s, kv_layer_bytes,
                                          kv_layer_seconds, live_exposed_seconds, logical_kv_bytes_layer,
                                          weight_layer_bytes, weight_layer_seconds)
from splash.costmodel.work import STAGES, Piece, Shapes, Work, ffn_work, layer_work, rank_key, step_extra
from splash.layouts.layout import LAYOUT_NAMES, check_heads, parse_layout
from splash.layouts.memory import kv_block_bytes, kv_bytes_per_token_layer
from splash.layouts.ownership import assign_owners
from splash.models.config import ModelConfig

LAYOUTS = LAYOUT_NAMES
ELEM_BYTES = {"float32": 4.0, "bfloat16": 2.0, "fp8_e4m3": 1.0, "int8": 1.0}
EXCHANGE_STAGES = ("exchange", "ffn_all_reduce")
# CP prefill: "partials" as splash/attention/cp.py runs it (the default), "split" as splash-sim assumes the paper's
# deployment runs it (splash.costmodel.work._cp_split)
CP_PREFILL = ("partials", "split")
# predictions a CostModel keeps (`step`: a pure function of its layout and rows). The layout scheduler asks the same
# step more than once — an executed step observed as it was predicted, the steps of one steady decode run trained on
# the same rows, a simulator charging a step the scheduler then observes — at milliseconds a prediction
STEP_MEMO = 256


@dataclass(frozen=True)
class RowLoad:
    """One request's piece of a step: ``new_tokens`` query rows (1 in decode, a chunk in prefill) over
    ``context`` tokens already in its KV; ``owner`` its owner rank (DP-attn/DOP) or CP anchor, None = let the
    model place it balanced; ``samples``: the piece's last row is sampled (LM head)."""
    new_tokens: int
    context: int
    owner: int | None = None
    samples: bool = True


@dataclass(frozen=True)
class StepPrediction:
    layout: str
    seconds: float
    per_rank: tuple[float, ...]
    stages: dict[str, float]                       # stage -> seconds on the busiest rank
    work: dict[str, dict[str, float]] = field(default_factory=dict)  # stage -> counted work, busiest rank


@dataclass(frozen=True)
class SwitchPrediction:
    src: str
    dst: str
    mode: str
    seconds: float                # all transfer (and conversion) time of the switch
    exposed_seconds: float        # what the handoff step pays on top of its own compute
    per_layer_seconds: float      # transfer time of one layer on the busiest rank
    recv_bytes: float             # busiest rank, all layers
    kv_layer_seconds: float = 0.0      # one layer's KV collective (busiest rank)
    weight_layer_seconds: float = 0.0  # one layer's projection all-gather (busiest rank)
    # prefix cache: of recv_bytes, the idle cached blocks' (busiest rank); idle cached blocks the switch keeps (all
    # ranks); moves of blocks running requests share (once per receiving rank)
    cached_recv_bytes: float = 0.0
    cached_blocks_kept: int = 0
    shared_moves: int = 0


def _elem(dtype: str, what: str) -> float:
    if dtype not in ELEM_BYTES:
        raise ValueError(f"unknown {what} {dtype!r} (allowed: {', '.join(ELEM_BYTES)})")
    return ELEM_BYTES[dtype]


class CostModel:
    def __init__(self, cfg: ModelConfig, world: int, profile: HardwareProfile, weight_dtype: str,
                 kv_dtype: str | Mapping[str, str], block_size: int = 16, act_dtype: str | None = None,
                 cp_prefill: str = "partials", rope_fp8: bool = False):
        """`rope_fp8`: the pool keeps an fp8 layer's rope key in e4m3 (splash.layouts.memory.rope_fp8_pool), so
        attention reads and switch moves are priced in its bytes."""
        if world < 1:
            raise ValueError(f"world must be positive, got {world}")
        if cp_prefill not in CP_PREFILL:
            raise ValueError(f"cp_prefill must be one of {', '.join(CP_PREFILL)}, got {cp_prefill!r}")
        self.cfg, self.world, self.profile, self.block_size = cfg, world, profile, block_size
        self.rope_fp8 = rope_fp8
        self.weight_dtype = weight_dtype
        self.act_dtype = act_dtype or ("float32" if weight_dtype == "float32" else "bfloat16")
        kvs = dict.fromkeys(LAYOUTS, kv_dtype) if isinstance(kv_dtype, str) else dict(kv_dtype)
        self.kv_dtypes = {parse_layout(k).value: v for k, v in kvs.items()}
        self._shapes = {}
        for lay in LAYOUTS:
            kvd = self.kv_dtypes.get(lay, next(iter(self.kv_dtypes.values())))
            with_idx = kv_bytes_per_token_layer(cfg, kvd, rope_fp8=rope_fp8)
            attn = kv_bytes_per_token_layer(_no_indexer(cfg), kvd, rope_fp8=rope_fp8)
            self._shapes[lay] = Shapes(cfg, world, _elem(weight_dtype, "weight dtype"),
                                       _elem(self.act_dtype, "activation dtype"), attn, with_idx - attn,
                                       block_size, profile.attention_scratch_bytes,
                                       cp_prefill=cp_prefill, cache=profile.attention_cache_bytes,
                                       prefill_attn=profile.prefill_attention_factor.get(lay, 1.0),
                                       row_kernel=profile.attention_row_kernel,
                                       fused=profile.fused_kernels)
        self.n_moe = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
        self.n_dense = cfg.num_hidden_layers - self.n_moe
        self._memo: OrderedDict = OrderedDict()   # (layout, rows) -> StepPrediction, the STEP_MEMO last asked

    # ---- owners ---------------------------------------------------------------------------------------
    def pieces(self, rows: Sequence[RowLoad]) -> list[Piece]:
        """Resolve owners: given ones kept, the rest placed balanced by KV tokens (splash.layouts.ownership)."""
        given = {str(i): (r.owner, r.context + r.new_tokens) for i, r in enumerate(rows) if r.owner is not None}
        for i, (o, _) in given.items():
            if not 0 <= o < self.world:
                raise ValueError(f"row {i}: owner {o} outside [0, {self.world})")
        free = {str(i): r.context + r.new_tokens for i, r in enumerate(rows) if r.owner is None}
        placed = assign_owners(free, given, self.world, None, block_size=self.block_size) if free else {}
        return [Piece(r.new_tokens, r.context, r.owner if r.owner is not None else placed[str(i)], r.samples)
                for i, r in enumerate(rows)]

    # ---- timing ---------------------------------------------------------------------------------------
    def stage_seconds(self, stage: str, w: Work) -> float:
        p = self.profile
        t = 0.0
        if w.gemm_flops or w.weight_bytes or w.act_bytes:
            if p.gemm_rows_flops_per_s.get(self.weight_dtype) and w.gemm_rows:
                compute = sum(f / p.gemm_rate_at(self.weight_dtype, r) for r, f in w.gemm_rows.items())
            else:
                compute = w.gemm_flops / p.gemm_rate(self.weight_dtype)
            t += max(compute, (w.weight_bytes + w.act_bytes) / p.memory_bytes_per_s)
        if w.attn_flops or w.kv_bytes:
            c, m = w.attn_flops / p.attention_flops_per_s, w.kv_bytes / p.kv_read_bytes_per_s
            t += c + m if p.attention_combine == "sum" else max(c, m)
        if w.attn_merge_bytes and p.attention_merge_bytes_per_s:
            t += w.attn_merge_bytes / p.attention_merge_bytes_per_s
        if w.attn_spill_bytes and p.attention_spill_bytes_per_s:
            t += w.attn_spill_bytes / p.attention_spill_bytes_per_s
        t += self.collective_seconds(w)
        t += (w.ops + (0.0 if p.moe_grouped else w.expert_ops)) * p.op_overhead_s * p.ops_scale
        t += w.plan_blocks * p.plan_block_s + w.plan_requests * p.plan_request_s
        t += w.attn_calls * (p.attention_call_s if p.attention_call_s else 14 * p.op_overhead_s * p.ops_scale)
        if p.alloc_bytes_per_s > 0:
            t += sum(b * n for b, n in w.temps if b >= p.alloc_threshold_bytes) / p.alloc_bytes_per_s
        return t

    def collective_seconds(self, w: Work) -> float:
        """The collectives' own time in a step: `HardwareProfile.collective_seconds` + ``collective_sync_s`` each."""
        p = self.profile
        return sum(n * (p.collective_seconds(kind, b) + p.collective_sync_s) for kind, b, n in w.exch)

    def _rank_stages(self, layout: str, pieces: list[Piece], rank: int) -> tuple[dict[str, float], dict[str, Work]]:
        s = self._shapes[layout]
        st = layer_work(s, layout, pieces, rank, moe=self.n_moe > 0)
        att = st["attention"]  # the attention plan is built once per step, not per layer
        total = {k: Work() for k in STAGES}
        total["plan"].add(Work(plan_blocks=att.plan_blocks, plan_requests=att.plan_requests))
        att.plan_blocks = att.plan_requests = 0.0
        L = self.cfg.num_hidden_layers
        for k, w in st.items():
            total[k].add(w, L if k != "ffn" or not self.n_moe else self.n_moe)
        if self.n_moe and self.n_dense:  # dense FFN layers (first_k_dense_replace)
            total["ffn"].add(ffn_work(s, sum(p.new for p in pieces), moe=False), self.n_dense)
        for k, w in step_extra(s, pieces).items():
            total[k].add(w)
        secs = {k: self.stage_seconds(k, w) for k, w in total.items()}
        secs["plan"] += self.profile.step_overhead_s + self.profile.step_overhead_layout_s.get(layout, 0.0)
        # waiting for the slower peer: the ranks drift apart while they compute, by a share of the time between
        # collectives, not by a fixed amount per collective (calibrate --in-step-collectives measures both)
        secs["sync"] = 0.0
        if self.profile.collective_wait_fraction:
            coll = sum(self.collective_seconds(w) for w in total.values())
            if coll:
                secs["sync"] = self.profile.collective_wait_fraction * (sum(secs.values()) - coll)
        hide = min(sum(secs[k] for k in EXCHANGE_STAGES),
                   self.profile.overlap_fraction * (secs["attention"] + secs["indexer"]))
        secs["overlap"] = -hide
        return secs, total

    def step(self, layout: str, rows: Sequence[RowLoad]) -> StepPrediction:
        """The step's predicted seconds (its busiest rank's) and that rank's stages. The same prediction object for
        the same layout and rows while it is among the last STEP_MEMO asked: callers must not change it."""
        check_heads(layout, self.cfg.num_attention_heads, self.world)
        layout = parse_layout(layout).value
        try:
            key = (layout, tuple(rows))
            hit = self._memo.get(key)
        except TypeError:   # rows of a type that cannot be a key
            key = hit = None
        if hit is not None:
            self._memo.move_to_end(key)
            return hit
        p = self._step(layout, rows)
        if key is not None:
            self._memo[key] = p
            while len(self._memo) > STEP_MEMO:
                self._memo.popitem(last=False)
        return p

    def _step(self, layout: str, rows: Sequence[RowLoad]) -> StepPrediction:
        pieces = self.pieces(rows)
        done: dict = {}   # ranks that do the same work (`rank_key`) share one count
        per = []
        for r in range(self.world):
            k = rank_key(layout, pieces, r)
            if k not in done:
                done[k] = self._rank_stages(layout, pieces, r)
            per.append(done[k])
        totals = tuple(sum(s.values()) for s, _ in per)
        busiest = max(range(self.world), key=lambda r: totals[r])
        work = {k: {"gemm_flops": w.gemm_flops, "weight_bytes": w.weight_bytes, "attn_flops": w.attn_flops,
                    "kv_bytes": w.kv_bytes, "exch_bytes": w.exch_bytes, "collectives": w.num_collectives,
                    "ops": w.ops, "expert_ops": w.expert_ops, "attn_calls": w.attn_calls}
                for k, w in per[busiest][1].items()}   # the busiest rank's only: the others' are not reported
        return StepPrediction(layout, totals[busiest], totals, per[busiest][0], work)

    def predict(self, rows: Sequence[RowLoad], layouts: Sequence[str] = LAYOUTS) -> dict[str, float]:
        """Predicted step seconds per layout (layouts whose head sharding does not divide are left out)."""
        out = {}
        for lay in layouts:
            try:
                out[parse_layout(lay).value] = self.step(lay, rows).seconds
            except ValueError:
                continue
        return out

    # ---- switching ------------------------------------------------------------------------------------
    def switch(self, manifest, mode: str, step_seconds: float | None = None,
               step_link_share: float = 0.0) -> SwitchPrediction:
        """Predicted cost of executing ``manifest``: per layer one KV all-to-all(v), one projection all-gather(v)
        (as the switch executor runs them) and a conversion's re-store; ``blocking`` pays all of it (×
        ``switch_blocking_factor``), ``live`` what the destination step (``step_seconds``, ``step_link_share`` of it
        in collectives) does not hide and what the hidden part slows it by (switch_cost.live_exposed_seconds)."""
        if mode not in ("live", "blocking"):
            raise ValueError(f"switch mode must be 'live' or 'blocking', got {mode!r}")
        L, T = manifest.num_layers, manifest.world
        per_layer, kv_t, w_t, nbytes = [], [], [], []
        logical = logical_kv_bytes_layer(manifest) if self.profile.switch_kv_volume == "logical" else None
        for r in range(T):
            kv = kv_layer_seconds(self.profile, manifest, r, logical)
            w = weight_layer_seconds(self.profile, manifest, r)
            per_layer.append(kv + w + self._convert_seconds(manifest, r))
            kv_t.append(kv)
            w_t.append(w)
            nbytes.append(kv_layer_bytes(self.profile, manifest, r, logical) + weight_layer_bytes(manifest, r))
        t_layer = max(per_layer)
        total = t_layer * L
        if mode == "blocking" or L == 0:
            exposed = blocking_seconds(self.profile, t_layer, L)
        else:
            exposed = live_exposed_seconds(self.profile, t_layer, L, step_seconds, step_link_share,
                                           nbytes[per_layer.index(t_layer)])
        recv = max(manifest.total_recv_bytes, default=0.0)
        return SwitchPrediction(manifest.src.value, manifest.dst.value, mode, total, exposed, t_layer, recv,
                                max(kv_t), max(w_t), max(cached_recv_bytes(manifest), default=0),
                                sum(map(len, manifest.cached_kept)), manifest.shared_moves)

    def _convert_seconds(self, manifest, r: int) -> float:
        """Re-storing the KV rank ``r`` holds after one layer's moves (read + write), when the format changes."""
        if not manifest.converts_kv:
            return 0.0
        held = len(manifest.keep[r]) + sum(1 for m in manifest.moves if m.dst_rank == r)
        per_block = manifest.kv_block_bytes_layer + manifest.dst_kv_block_bytes_layer
        return held * per_block / self.profile.memory_bytes_per_s


def _no_indexer(cfg: ModelConfig) -> ModelConfig:
    return dataclasses.replace(cfg, index_head_dim=0, index_n_heads=0, index_topk=0)


def cached_moves_pay(model, dst: str, hit_rate: float, chunk_tokens: int) -> bool:
    """Whether idle cached blocks are worth sending with a switch into `dst` (`model`: a CostModel): one block's
    whole transfer (as a blocking switch pays it: the cautious side) costs less than the recompute a hit on it saves
    — its tokens' share of a `chunk_tokens` prefill chunk in `dst` — times the cache's `hit_rate` so far."""
    if hit_rate <= 0:
        return False
    bs = model.block_size
    kv = model.kv_dtypes.get(dst, next(iter(model.kv_dtypes.values())))
    move_s = kv_block_bytes(model.cfg, kv, bs, model.rope_fp8) / kv_bytes_per_s(model.profile)
    chunk = max(bs, chunk_tokens)   # a prompt token's share of one chunk's prefill step from position 0
    recompute_s = model.step(dst, [RowLoad(new_tokens=chunk, context=0, owner=0)]).seconds / chunk * bs
    return move_s < hit_rate * recompute_s
