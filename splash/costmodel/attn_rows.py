"""The attention counts of a row kernel (SPLASH's CPU `mla_decode`: every query row of a step, one call a layer).

Each query row scores the keys it sees: a decode row its request's keys here, row i of an n-row prefill chunk the
history plus i + 1 (n × (keys − (n − 1) / 2) over the chunk); a request's keys are read from memory once (its
rows re-read them from cache). No padding to the longest history, no chunks, no merges. Pure Python, no torch.
"""
from __future__ import annotations


def row_attention(w, pieces, per_key: float, kv_tok: float, prefill_attn: float, topk: int | None,
                  new_here=None) -> None:
    """Add to Work `w` the FLOPs, KV bytes and plan entries of `pieces` — (piece, visible keys here, held
    blocks here) — at `per_key` FLOPs per (row, key) and `kv_tok` bytes per key; `prefill_attn` scales prefill
    pieces (the profile's measured factor), `topk` caps the keys a row sees (DSA). `new_here[i]`: how many of
    piece i's own new positions are among the keys here (default all; CP holds about 1/T of a chunk's), spread
    evenly over the chunk, so its row j sees the history here plus about new_here·(j + 1)/n of them."""
    for i, (p, k, _) in enumerate(pieces):
        if p.new <= 0:
            continue
        own = p.new if new_here is None else new_here[i]
        keys = min(k, topk) if topk else k
        seen = keys if p.new == 1 or topk else max(0.0, keys - own * (p.new - 1) / (2 * p.new))
        factor = 1.0 if p.new == 1 else prefill_attn
        w.attn_flops += p.new * seen * per_key * factor
        w.kv_bytes += (keys if not topk else min(k, p.new * topk)) * kv_tok * factor
    w.plan_requests += len(pieces)
    w.plan_blocks += sum(b for _, _, b in pieces)
