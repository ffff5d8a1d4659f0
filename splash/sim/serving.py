"""Predicted serving of B requests of (input, output) tokens per layout, KV capacity and switch cost. No torch.

The serving model (stated, not measured):
- every layout holds the whole request (input + output tokens) in KV from admission; requests that do not
  fit wait for the previous wave (the requests are identical, so continuous batching runs them in waves);
  TP's capacity is one rank's pool (it replicates the latent), DP-attn/DOP's is per owner (a request lives on
  one rank), CP's is the group's pool (position-sharded);
- prefill is chunked (``chunk`` prompt tokens a step: per owner in the request-owned layouts with ``owner_prefill``,
  else in admission order, `_prefill_steps`; how CP splits a chunk is the cost model's ``cp_prefill``); decode then
  runs one row per request per step;
- throughput counts input + output tokens over the whole run (the paper's total throughput);
- the linear-attention layers of a hybrid model (SimModel) cost the same in every layout.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from splash.costmodel.profile import HardwareProfile
from splash.costmodel.step_cost import ELEM_BYTES, LAYOUTS, CostModel, RowLoad
from splash.costmodel.work import Shapes, Work, ffn_work
from splash.layouts.layout import parse_layout
from splash.layouts.memory import common_params, kv_capacity_tokens
from splash.layouts.ownership import blocks_held, kv_copies
from splash.sim.presets import SimModel
from splash.sim.storage import RUNTIME_RESERVE_BYTES, kv_share, storage_delta_bytes

DECODE_SAMPLES = 6


@dataclass(frozen=True)
class SimSetup:
    model: SimModel
    profile: HardwareProfile
    world: int
    mem_fraction: float = 0.85
    block_size: int = 64
    chunk: int = 16384
    reserve_bytes: float = RUNTIME_RESERVE_BYTES
    owner_prefill: bool = True   # DP-attn/DOP split the step's chunk budget over the owners (SGLang DP-attention)
    storage: str = "sglang"      # how the deployment stores weights and state (splash.sim.storage)
    # "colocated": prefill and decode in the swept layout on these ranks; "disaggregated": prefill here, decode
    # on a separate instance of ``decode_world`` ranks over ``decode_nodes`` nodes in ``decode_layout``, the KV
    # handed off over the inter-node link (splash.sim.deploy)
    deployment: str = "colocated"
    decode_layout: str = "dp_attn"
    decode_world: int = 8
    decode_nodes: int = 1

    def __post_init__(self):
        if self.deployment not in ("colocated", "disaggregated"):
            raise ValueError(f"deployment must be colocated or disaggregated, got {self.deployment!r}")
        if self.decode_layout not in LAYOUTS:
            raise ValueError(f"decode_layout must be one of {', '.join(LAYOUTS)}, got {self.decode_layout!r}")
        if self.decode_world < 1 or self.decode_nodes < 1:
            raise ValueError(f"decode_world and decode_nodes must be >= 1, got {self.decode_world}, "
                             f"{self.decode_nodes}")

    @property
    def budget(self) -> float:
        if self.profile.memory_bytes <= 0:
            raise ValueError(f"hardware profile {self.profile.name!r} has no memory_bytes: capacity is unknown")
        return self.mem_fraction * self.profile.memory_bytes


def linear_common_bytes(m: SimModel, world: int) -> float:
    """Per-rank weight bytes of the linear layers (their FFN/MoE and attention weights, sharded /T)."""
    if not m.linear_layers:
        return 0.0
    lin = dataclasses.replace(m.full, num_hidden_layers=m.linear_layers, first_k_dense_replace=m.linear_dense_layers,
                              index_head_dim=0, index_n_heads=0, q_lora_rank=None, kv_lora_rank=0,
                              qk_rope_head_dim=0, hybrid=None)  # plain FFN + norms view
    ffn_and_norms = common_params(lin, world) - common_params(dataclasses.replace(lin, num_hidden_layers=0), world)
    return (ffn_and_norms + m.linear_layers * m.linear_params / world) * ELEM_BYTES[m.weight_dtype]


# A quantised checkpoint stores its linear weights in 1 byte + scales and everything else (embeddings, LM head,
# norms, router) in the compute dtype: capacity counts those stored bytes (splash.layouts.memory weight_quant).
WEIGHT_QUANT = {"fp8_e4m3": "fp8", "int8": "int8"}


def stored_weights(weight_dtype: str) -> tuple[float, str | None]:
    """(element bytes of the unquantised weights, weight_quant) for a weight dtype."""
    q = WEIGHT_QUANT.get(weight_dtype)
    return (ELEM_BYTES["bfloat16"], q) if q else (ELEM_BYTES[weight_dtype], None)


def capacities(s: SimSetup) -> dict[str, object]:
    """CapacityReport per layout (splash.layouts.memory.kv_capacity_tokens) for the MLA layers' KV, with the
    weights counted as stored (FP8/INT8 linears + scales; embeddings, LM head, norms in BF16), as the
    deployment's ``storage`` keeps them (splash.sim.storage), and — for a hybrid model under SGLang storage —
    the recurrent-state pool's share of the room taken out."""
    m = s.model
    extra = linear_common_bytes(m, s.world) + s.reserve_bytes
    elem, quant = stored_weights(m.weight_dtype)
    share = kv_share(s.storage, m.linear_layers > 0)
    out = {}
    for lay in LAYOUTS:
        fixed = extra + storage_delta_bytes(m.cfg, lay, s.world, s.storage)
        c = kv_capacity_tokens(m.cfg, lay, s.world, s.budget, elem, m.kv_dtype, s.block_size,
                               reserve_bytes=int(fixed), weight_quant=quant)
        if share < 1.0:
            room = c.room_bytes_per_rank * share
            per_rank = int(room // c.block_bytes)
            distinct = per_rank * s.world // kv_copies(lay, s.world)
            c = dataclasses.replace(c, room_bytes_per_rank=room, blocks_per_rank=per_rank, distinct_blocks=distinct,
                                    distinct_tokens=distinct * s.block_size)
        out[lay] = c
    return out


def concurrency(s: SimSetup, caps: dict, layout: str, tokens: int) -> int:
    """Requests of ``tokens`` KV tokens the layout holds at once: its busiest rank's blocks of one request (the
    ownership model's), on every rank or — request-owned layouts — on its owner alone."""
    per_rank = max(blocks_held(layout, 0, 0, -(-tokens // s.block_size), s.world))
    if per_rank == 0:
        return 0
    return (s.world if parse_layout(layout).owner_based else 1) * (caps[layout].blocks_per_rank // per_rank)


def linear_seconds(cm: CostModel, m: SimModel, rows: list[RowLoad]) -> float:
    """Step seconds of the linear-attention layers (same in every layout), via the cost model's stage timing."""
    if not m.linear_layers:
        return 0.0
    T, hid = cm.world, m.full.hidden_size
    wb, ab = ELEM_BYTES[m.weight_dtype], ELEM_BYTES[cm.act_dtype]
    n = sum(r.new_tokens for r in rows)
    state = m.linear_heads * m.linear_head_dim ** 2 * 4.0
    w = Work()
    w.gemm_flops = 2.0 * n * m.linear_params / T
    w.weight_bytes = m.linear_params / T * wb
    w.act_bytes = n * hid * 4 * ab
    w.attn_flops = 4.0 * n * state / 4.0 / T   # state update + readout per token, 2 FLOPs per element each
    w.kv_bytes = 2.0 * len(rows) * state / T   # each request's state read and written once per step
    w.ops = 30
    if T > 1:
        w.exch += [("all_reduce", n * hid * ab, 1)] * 2
    per = cm.stage_seconds("attention", w)
    sh = Shapes(m.full, T, wb, ab, 0.0, 0.0, cm.block_size)
    moe = ffn_work(sh, n, moe=True)   # the MLA layers' FFN counting, reused for the linear layers' FFN
    return (m.linear_layers * per + (m.linear_layers - m.linear_dense_layers) * cm.stage_seconds("ffn", moe)
            + m.linear_dense_layers * cm.stage_seconds("ffn", ffn_work(sh, n, moe=False)))


def step_stages(cm: CostModel, m: SimModel, layout: str, rows: list[RowLoad]) -> tuple[float, dict[str, float]]:
    """A step's seconds and its seconds per stage: the cost model's stages plus the linear-attention layers'."""
    p = cm.step(layout, rows)
    lin = linear_seconds(cm, m, rows)
    return p.seconds + lin, ({**p.stages, "linear": lin} if lin else p.stages)


def step_seconds(cm: CostModel, m: SimModel, layout: str, rows: list[RowLoad]) -> float:
    return step_stages(cm, m, layout, rows)[0]


def _prefill_steps(k: int, input_len: int, chunk: int, world: int, per_owner: bool) -> list[list[RowLoad]]:
    """Chunked prefill steps of k requests (request j on owner / anchor j % world): one ``chunk`` budget a step for
    the group, spent in admission order (the engine's scheduler), or with ``per_owner`` a fixed ``chunk // world``
    for every owner with prompt tokens left, spent on its own requests in admission order — SGLang's DP-attention
    divides ``chunked_prefill_size`` by ``dp_size`` once at start-up (server_args ``_handle_data_parallelism``) and
    an idle owner's share is not handed on, so fewer busy owners (B < T, a wave's tail) prefill fewer tokens a step."""
    if input_len <= 0:
        return []
    groups = [list(range(o, k, world)) for o in range(min(k, world))] if per_owner else [list(range(k))]
    share = max(1, chunk // world) if per_owner else chunk
    done = [0] * k
    steps = []
    while any(groups):
        rows = []
        for g in groups:
            budget = share
            while budget > 0 and g:
                j = g[0]
                take = min(budget, input_len - done[j])
                rows.append(RowLoad(take, done[j], j % world, samples=done[j] + take == input_len))
                done[j] += take
                budget -= take
                if done[j] == input_len:
                    g.pop(0)
        steps.append(rows)
    return steps


def prefill_seconds(cm: CostModel, s: SimSetup, layout: str, k: int, input_len: int) -> float:
    """Chunked prefill of ``k`` requests of ``input_len`` prompt tokens in ``layout``."""
    steps = _prefill_steps(k, input_len, s.chunk, s.world, s.owner_prefill and parse_layout(layout).owner_based)
    return sum(step_seconds(cm, s.model, layout, rows) for rows in steps)


def wave_seconds(cm: CostModel, s: SimSetup, layout: str, k: int, input_len: int, output_len: int) -> float:
    t = prefill_seconds(cm, s, layout, k, input_len)
    if output_len > 0:
        # decode: the step cost grows linearly with context; sample it and integrate (midpoints)
        n = min(DECODE_SAMPLES, output_len)
        per = output_len / n
        for i in range(n):
            ctx = input_len + int((i + 0.5) * per)
            t += per * step_seconds(cm, s.model, layout, [RowLoad(1, ctx, j % s.world) for j in range(k)])
    return t


def wave_completions(sizes: list[int], seconds: list[float]) -> list[float]:
    """Completion time of every request when waves of ``sizes`` requests run one after another, wave i taking
    ``seconds[i]`` and finishing its requests together (the wave model above: a wave prefills, then its requests
    decode together)."""
    if len(sizes) != len(seconds):
        raise ValueError(f"{len(sizes)} wave sizes but {len(seconds)} wave times")
    out, t = [], 0.0
    for n, dt in zip(sizes, seconds):
        t += dt
        out += [t] * n
    return out


def burst(cm: CostModel, s: SimSetup, caps: dict, layout: str, batch: int, input_len: int,
          output_len: int) -> dict[str, object]:
    """``batch`` identical requests arriving at once, served in waves of as many as the layout holds (the
    paper's co-located admission run): {"waves", "wave_s", "makespan_s", "mean_completion_s",
    "input_tokens_per_s"}, or {"feasible": False} when no request fits."""
    k = min(batch, concurrency(s, caps, layout, input_len + output_len))
    if k == 0:
        return {"feasible": False}
    full, rest = divmod(batch, k)
    sizes = [k] * full + ([rest] if rest else [])
    per = {n: wave_seconds(cm, s, layout, n, input_len, output_len) for n in set(sizes)}
    secs = [per[n] for n in sizes]
    done = wave_completions(sizes, secs)
    return {"feasible": True, "waves": sizes, "wave_s": secs, "makespan_s": done[-1],
            "mean_completion_s": sum(done) / len(done), "input_tokens_per_s": batch * input_len / done[-1]}
