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
from splash.costmodel.work import (STAGES, LayerRows, Piece, Shapes, Work, ffn_work, keys_work, layer_rows, rank_key,
                                   rows_work, step_extra)
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
ROWS_MEMO = 4096   # stage counts and seconds kept per row counts (`CostModel._rows_stages`), cleared when full
# the stages whose work depends on the keys each row attends (`work.keys_work`), counted at every step
KEY_STAGES = ("plan", "attention", "indexer")


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
        self._rows: dict = {}                      # `_rows_stages`

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
        r, held, new_here, ex = layer_rows(s, layout, pieces, rank)
        keys = keys_work(s, r, held, new_here)
        att = keys["attention"]  # the attention plan is built once per step, not per layer
        rows = self._rows_stages(layout, r, pieces)
        L = self.cfg.num_hidden_layers
        total, secs, coll = {}, {}, {}
        for k in STAGES:
            if k in rows:
                total[k], secs[k], coll[k] = rows[k]
                continue
            w = total[k] = Work()
            if k == "plan":
                w.add(Work(plan_blocks=att.plan_blocks, plan_requests=att.plan_requests))
                att.plan_blocks = att.plan_requests = 0.0
            elif k == "indexer":
                layer = Work()
                layer.add(rows["layer_indexer"])
                layer.add(keys["indexer"])   # its projections and its scoring count different fields
                w.add(layer, L)
            else:   # the attention; the exchange of CP's split prefill
                w.add(att if k == "attention" else ex, L)
            secs[k], coll[k] = self.stage_seconds(k, w), self.collective_seconds(w)
        secs["plan"] += self.profile.step_overhead_s + self.profile.step_overhead_layout_s.get(layout, 0.0)
        # waiting for the slower peer: the ranks drift apart while they compute, by a share of the time between
        # collectives, not by a fixed amount per collective (calibrate --in-step-collectives measures both)
        secs["sync"] = 0.0
        if self.profile.collective_wait_fraction:
            c = sum(coll[k] for k in STAGES)
            if c:
                secs["sync"] = self.profile.collective_wait_fraction * (sum(secs.values()) - c)
        hide = min(sum(secs[k] for k in EXCHANGE_STAGES),
                   self.profile.overlap_fraction * (secs["attention"] + secs["indexer"]))
        secs["overlap"] = -hide
        return secs, total

    def _rows_stages(self, layout: str, r: LayerRows, pieces: list[Piece]) -> dict:
        """Per stage whose work depends on row counts only (all but KEY_STAGES, and the exchange of CP's split
        prefill), its step's work on the rank (L layers, the dense FFN layers, the per-step extras), seconds and
        collective seconds — counted once per layout, `LayerRows` and sampled rows; and the layer's indexer
        projections (`layer_indexer`)."""
        samples = sum(1 for p in pieces if p.samples)
        key = (layout, r, samples)
        out = self._rows.get(key)
        if out is not None:
            return out
        s = self._shapes[layout]
        st = rows_work(s, layout, r, moe=self.n_moe > 0)
        L = self.cfg.num_hidden_layers
        total = {k: Work() for k in STAGES if k not in KEY_STAGES and (k != "exchange" or r.exchange)}
        for k, w in total.items():
            w.add(st[k], L if k != "ffn" or not self.n_moe else self.n_moe)
        if self.n_moe and self.n_dense:  # dense FFN layers (first_k_dense_replace)
            total["ffn"].add(ffn_work(s, sum(p.new for p in pieces), moe=False), self.n_dense)
        for k, w in step_extra(s, pieces).items():
            total[k].add(w)
        out = {k: (w, self.stage_seconds(k, w), self.collective_seconds(w)) for k, w in total.items()}
        out["layer_indexer"] = st["indexer"]
        if len(self._rows) >= ROWS_MEMO:
            self._rows.clear()
        self._rows[key] = out
        return out

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
