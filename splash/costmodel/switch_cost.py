"""How a switch's per-layer primitives are priced and how a live switch hides them; each mechanism is chosen by
the hardware profile (the defaults keep the collectives-table pricing the CPU profile was measured with). No torch.

- ``switch_kv_efficiency`` / ``switch_weight_efficiency``: a layer's KV collective and projection all-gather each
  run at their own share of ``link_bytes_per_s`` (shares fitted on the paper's B200 per-layer costs, splash/sim/fit.py).
- ``switch_kv_volume: logical``: every KV collective carries (T-1)/T of the layer's whole live KV, whatever a rank
  receives — the paper's seven KV directions cost within 1.10x of each other on B200 while their received bytes
  differ 8x (docs/benchmarks.md; tests/test_switch_cost.py).
- ``switch_overlap: pipeline``: layer l+1's state moves while layer l computes (paper §4.1); the live switch exposes
  the handoff, layer 0's transfer, what each later layer's exceeds one layer of the step, and what the hidden
  transfers slow the step by (App. G: they share "interconnect and memory bandwidth"): ``switch_contention_on:
  link``, the step's own collectives wait on the shared link; ``memory``, the transfer's bytes cross HBM while the
  step computes. ``budget``: later layers hide behind ``overlap_fraction`` of a layer.
- ``switch_blocking_factor``: a blocking switch takes that many times its primitives back to back; the extra scales
  with the bytes moved (fitted on B200's DOP->CP blocking; why not a fixed cost: splash/sim/fit.py).
- Prefix cache: the manifest moves a shared block once per receiving rank, so its bytes are deduplicated already;
  whether idle cached blocks are sent at all is ``step_cost.cached_moves_pay``.
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


def kv_layer_bytes(profile, manifest, rank: int, logical: float | None = None) -> float:
    """The bytes one layer's KV collective carries on ``rank``'s link (0 when no KV moves): (T-1)/T of the layer's
    logical KV under ``switch_kv_volume: logical``, else what the rank receives or sends, the larger."""
    if not any(manifest.kv_recv_bytes):
        return 0.0
    if profile.switch_kv_efficiency > 0 and profile.switch_kv_volume == "logical":
        T = manifest.world
        return (T - 1) / T * (logical_kv_bytes_layer(manifest) if logical is None else logical)
    return float(max(manifest.kv_recv_bytes[rank], manifest.kv_sent_bytes[rank]))


def kv_layer_seconds(profile, manifest, rank: int, logical: float | None = None) -> float:
    """One layer's KV collective on ``rank`` (0 when no KV moves)."""
    nbytes = kv_layer_bytes(profile, manifest, rank, logical)
    if not nbytes:
        return 0.0
    if profile.switch_kv_efficiency > 0:
        return (profile.collective("all_to_all").alpha_s
                + nbytes / (profile.switch_kv_efficiency * profile.link_bytes_per_s))
    return profile.collective_seconds("all_to_all", nbytes)


def weight_layer_bytes(manifest, rank: int) -> float:
    """The projection bytes ``rank`` receives in one layer's all-gather."""
    return float(manifest.weight_recv_bytes[rank]) if any(manifest.weight_recv_bytes) else 0.0


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
                         step_link_share: float = 0.0, layer_bytes: float = 0.0) -> float:
    """What a live switch adds to the step it runs in, for ``layers`` layers of ``t_layer`` transfer each.

    budget: layer 0 waits, later layers hide behind ``overlap_fraction`` of one destination layer.
    pipeline: layer 0 waits; layer l's transfer runs under layer l-1's whole computation (``step_seconds`` /
    layers), exposing what exceeds it, and the hidden part slows the step (``contention_seconds``: by the share of
    the step its collectives take, ``step_link_share``, or by the hidden share of the layer's ``layer_bytes``)."""
    if layers <= 0 or t_layer <= 0:
        return profile.switch_handoff_s if profile.switch_overlap == "pipeline" else 0.0
    c = step_seconds / layers if step_seconds else 0.0
    if profile.switch_overlap == "pipeline":
        hidden = min(t_layer, c)
        slow = contention_seconds(profile, hidden, t_layer, step_link_share, layer_bytes)
        return profile.switch_handoff_s + t_layer + (layers - 1) * (t_layer - hidden + slow)
    hide = profile.overlap_fraction * c
    return t_layer + (layers - 1) * max(0.0, t_layer - hide)


def contention_seconds(profile, hidden: float, t_layer: float, step_link_share: float, layer_bytes: float) -> float:
    """How much one layer's hidden transfer (``hidden`` of its ``t_layer`` seconds) slows the step it hides in.

    link: the step's collectives share the link with it — ``switch_contention`` × hidden × the step's collective
    share. memory: the hidden share of the layer's ``layer_bytes`` is written to (and read from) HBM while the
    step's kernels use it — ``switch_contention`` × the seconds those bytes take at ``memory_bytes_per_s``."""
    if hidden <= 0:
        return 0.0
    if profile.switch_contention_on == "memory":
        return profile.switch_contention * (hidden / t_layer) * layer_bytes / profile.memory_bytes_per_s
    return profile.switch_contention * hidden * step_link_share


def blocking_seconds(profile, t_layer: float, layers: int) -> float:
    """A blocking switch: its ``layers`` per-layer primitives back to back, × ``switch_blocking_factor``."""
    return profile.switch_blocking_factor * t_layer * layers


def kv_bytes_per_s(profile) -> float:
    """The rate one rank receives a switch's KV at: the KV collective's share of the link, else its all-to-all's."""
    if profile.switch_kv_efficiency > 0 and profile.link_bytes_per_s > 0:
        return profile.switch_kv_efficiency * profile.link_bytes_per_s
    return profile.collective("all_to_all").bytes_per_s
