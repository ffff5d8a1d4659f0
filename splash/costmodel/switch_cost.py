"""How a switch's per-layer primitives are priced and how a live switch hides them. Pure, no torch.

Two mechanisms, each chosen by the hardware profile (the defaults keep the collectives-table pricing and the
overlap budget that the CPU profile was measured with):

**Per-primitive link efficiency** (``switch_kv_efficiency``, ``switch_weight_efficiency`` of ``link_bytes_per_s``):
one layer's KV collective and projection all-gather each run at their own share of the rank's one-direction link
rate. The shares are fitted on the paper's B200 per-layer costs only (splash/sim/fit.py); the H200 and DCU
profiles carry the same shares and their own spec-sheet link rates.

**Logical KV volume** (``switch_kv_volume: logical``): the paper's seven KV directions (all-gathers into TP,
all-to-alls between CP and the request-owned layouts) cost 3.471-3.807 ms a layer on B200 at B = 16 x 256K,
within 1.10x of each other, while the state each rank receives differs 8x between them (an all-gather into TP
receives 7/8 of the layer's live KV, an all-to-all between CP and DOP 1/8 of that), and H200's DOP->CP follows "the
linear B·s context trend". A pricing by received bytes cannot give that spread; pricing every KV collective at
(T-1)/T of the layer's whole live KV — every rank's link carries the whole logical buffer, as an all-gather of the
layer followed by local selection would — gives it (tests/test_switch_cost.py).

**Pipelined live switch** (``switch_overlap: pipeline``): layer l+1's state moves while layer l computes (paper
§4.1), so a live switch exposes the handoff (``switch_handoff_s``: what a discard-only switch costs), layer 0's
transfer, each later layer's transfer beyond one layer of the step it runs in, and the delay the hidden transfers
cause the step's own collectives, which share the link (App. G): ``switch_contention`` × hidden transfer × the
share of the step spent in collectives. The handoff and the contention coefficient are fitted on B200's smallest
and DOP->CP p50s (splash/sim/fit.py). ``budget`` is the older form: later layers hide behind ``overlap_fraction``
of a layer.

**Prefix cache** (splash.switching.block_plan): a switch moves each shared prefix block once per receiving rank, so
the bytes priced above are already deduplicated; idle cached blocks the manifest sends are part of them too. Whether
idle blocks may be sent at all is ``cached_moves_pay``: one block's transfer at the KV collective's rate against the
recompute it is expected to save (its tokens' share of a prefill chunk, times the cache's hit rate so far).
"""
from __future__ import annotations


def logical_kv_bytes_layer(manifest) -> float:
    """One layer's live KV over the whole group (each request's blocks once, a block requests share once, plus the
    idle cached blocks the switch moves), from the manifest's blocks."""
    if manifest.logical_blocks:
        return manifest.logical_blocks * float(manifest.kv_block_bytes_layer)
    blocks = set()
    for per_rank in (*manifest.keep, *manifest.discard):
        blocks.update(per_rank)
    blocks.update((m.req, m.block_idx) for m in manifest.moves)
    return len(blocks) * float(manifest.kv_block_bytes_layer)


def cached_recv_bytes(manifest) -> tuple[int, ...]:
    """Per rank, the bytes of idle cached blocks it receives in the switch (every layer holding paged KV)."""
    out = [0] * manifest.world
    for mv in manifest.moves:
        if mv.h is not None and mv.req == "":
            out[mv.dst_rank] += manifest.kv_block_bytes_total
    return tuple(out)


def kv_layer_seconds(profile, manifest, rank: int, logical: float | None = None) -> float:
    """One layer's KV collective on ``rank`` (0 when no KV moves)."""
    if not any(manifest.kv_recv_bytes):
        return 0.0
    alpha = profile.collective("all_to_all").alpha_s
    if profile.switch_kv_efficiency > 0:
        if profile.switch_kv_volume == "logical":
            T = manifest.world
            nbytes = (T - 1) / T * (logical_kv_bytes_layer(manifest) if logical is None else logical)
        else:
            nbytes = max(manifest.kv_recv_bytes[rank], manifest.kv_sent_bytes[rank])
        return alpha + nbytes / (profile.switch_kv_efficiency * profile.link_bytes_per_s)
    return profile.collective_seconds("all_to_all", max(manifest.kv_recv_bytes[rank], manifest.kv_sent_bytes[rank]))


def weight_layer_seconds(profile, manifest, rank: int) -> float:
    """One layer's projection all-gather on ``rank`` (0 when no projections move)."""
    if not any(manifest.weight_recv_bytes):
        return 0.0
    if profile.switch_weight_efficiency > 0:
        return (profile.collective("all_gather").alpha_s
                + manifest.weight_recv_bytes[rank] / (profile.switch_weight_efficiency * profile.link_bytes_per_s))
    shard = manifest.weight_sent_bytes[rank] / max(1, manifest.world - 1)
    return profile.collective_seconds("all_gather", manifest.weight_recv_bytes[rank] + shard)


def live_exposed_seconds(profile, t_layer: float, layers: int, step_seconds: float | None,
                         step_link_share: float = 0.0) -> float:
    """What a live switch adds to the step it runs in, for ``layers`` layers of ``t_layer`` transfer each.

    budget: layer 0 waits, later layers hide behind ``overlap_fraction`` of one destination layer.
    pipeline: layer 0 waits; layer l's transfer runs under layer l-1's whole computation (``step_seconds`` /
    layers), exposing what exceeds it, and the hidden part slows the step's own collectives by the share of the
    step they take (``step_link_share``: they share the link)."""
    if layers <= 0 or t_layer <= 0:
        return profile.switch_handoff_s if profile.switch_overlap == "pipeline" else 0.0
    c = step_seconds / layers if step_seconds else 0.0
    if profile.switch_overlap == "pipeline":
        hidden = min(t_layer, c)
        return (profile.switch_handoff_s + t_layer
                + (layers - 1) * (t_layer - hidden + profile.switch_contention * hidden * step_link_share))
    hide = profile.overlap_fraction * c
    return t_layer + (layers - 1) * max(0.0, t_layer - hide)


def kv_bytes_per_s(profile) -> float:
    """The rate one rank receives a switch's KV at: the KV collective's share of the link, else its all-to-all's."""
    if profile.switch_kv_efficiency > 0 and profile.link_bytes_per_s > 0:
        return profile.switch_kv_efficiency * profile.link_bytes_per_s
    return profile.collective("all_to_all").bytes_per_s


def cached_moves_pay(model, dst: str, hit_rate: float, chunk_tokens: int) -> bool:
    """Whether idle cached blocks are worth sending with a switch into `dst` (`model`: a CostModel): one block's
    transfer over every layer costs less than the recompute a hit on it saves — its tokens' share of a prefill chunk
    of `chunk_tokens` in `dst` — times `hit_rate`, the share of looked-up prompt tokens the cache has found so far (no
    lookups yet: nothing is expected of it). A live switch hides part of the transfer behind the step; pricing all of
    it, as a blocking switch pays it, keeps the rule on the cautious side."""
    from splash.layouts.memory import kv_block_bytes

    if hit_rate <= 0:
        return False
    bs = model.block_size
    kv = model.kv_dtypes.get(dst, next(iter(model.kv_dtypes.values())))
    move_s = kv_block_bytes(model.cfg, kv, bs) / kv_bytes_per_s(model.profile)
    recompute_s = model.prefill_seconds_per_token(dst, max(bs, chunk_tokens)) * bs
    return move_s < hit_rate * recompute_s
