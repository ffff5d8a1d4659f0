"""Shared set-up for the layout and switch benchmarks: a rank's ModelRunner whose paged KV already holds B
requests of L tokens (random latent values written straight into the pool on the ranks the layout says hold
them — decode-step cost does not depend on the values), and a timed decode step. With ``prefill`` = C, every
step also carries a C-token prefill chunk from position 0 of one more request (owner / CP anchor rank 0), the
same chunk re-run each step — a step of the kind a prompt arriving during decode makes. With ``shared_prefix`` = P,
the first P // block_size blocks of every request are one cached prefix (a shared system prompt, the prompt of n
samples): each rank holds one block per prefix position, named by a prefix hash and referenced by every request it
holds that block of, as the prefix cache leaves them."""
from __future__ import annotations

import time

import torch

from splash.attention.batch import StepBatch, StepRequest
from splash.engine.runner import ModelRunner
from splash.layouts.ownership import kv_holders
from splash.models.presets import preset_config, preset_getter

FILL_CHUNK_SLOTS = 65536   # random KV written per call: bounds the fp32 transient (128 MiB at a 512-wide latent)


class DecodeState:
    def __init__(self, comm, preset: str, layout: str, batch: int, context: int, block_size: int = 16,
                 kv_dtype: str = "float32", spare_blocks: int = 64, prefill: int = 0, shared_prefix: int = 0):
        self.comm, self.B, self.L, self.prefill = comm, batch, context, prefill
        self.hashes = tuple(range(1, 1 + min(shared_prefix, context) // block_size))
        cfg = preset_config(preset)
        nb = -(-(context + 64) // block_size)
        blocks = batch * nb + spare_blocks + -(-prefill // block_size)  # enough for TP (every rank holds all)
        self.runner = ModelRunner(cfg, preset_getter(preset), comm, layout, kv_dtype, block_size, blocks)
        self.owners = {f"r{i}": i % comm.size for i in range(batch)}
        self.pos = {rid: context for rid in self.owners}
        self._fill()

    def _fill(self) -> None:
        r, bs, me = self.runner, self.runner.block_size, self.comm.rank
        g = torch.Generator().manual_seed(0)
        nb = -(-self.L // bs)
        slots = []   # every fresh slot this rank holds, written a chunk at a time (a call per block: ~1e5 calls)
        for rid, owner in self.owners.items():
            held = [b for b, h in enumerate(kv_holders(r.layout, nb, owner, self.comm.size)) if me in h]
            hit = [(b, self.hashes[b]) for b in held if b < len(self.hashes) and r.bm.cached(self.hashes[b])]
            if hit:
                r.attach(rid, hit)
            r.ensure_blocks(rid, held)
            t = r.bm.table(rid)
            for b in held:
                if b < len(self.hashes) and not r.bm.cached(self.hashes[b]):
                    r.bm.register(rid, b, self.hashes[b])
            slots += [torch.arange(t[b] * bs, t[b] * bs + min(bs, self.L - b * bs))
                      for b in held if b not in dict(hit)]
        slots = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
        for layer in range(r.cfg.num_hidden_layers):
            for part in slots.split(FILL_CHUNK_SLOTS):
                r.cache.write(layer, part, torch.randn(len(part), r.cfg.kv_lora_rank, generator=g),
                              torch.randn(len(part), r.cfg.qk_rope_head_dim, generator=g))

    def batch(self) -> StepBatch:
        reqs = [StepRequest(rid, self.pos[rid], 1, self.owners[rid]) for rid in self.owners]
        tokens = [[7] for _ in reqs]
        if self.prefill:
            reqs.append(StepRequest("prefill", 0, self.prefill, 0))
            tokens.append([7] * self.prefill)
        return StepBatch.build(reqs, tokens, [True] * len(reqs))

    def local_step(self, switch=None, clock=time.perf_counter) -> float:
        """One decode step (optionally carrying a switch) after a barrier; returns this rank's time in seconds by
        ``clock`` (wall by default; ``time.thread_time``: the rank's CPU time, robust to a loaded host)."""
        b = self.batch()
        self.comm.barrier()
        t0 = clock()
        self.runner.step(b, switch)
        dt = clock() - t0
        for rid in self.pos:
            self.pos[rid] += 1
        return dt

    def step(self, switch=None, clock=time.perf_counter) -> float:
        """`local_step`, as the max over ranks."""
        return max(self.comm.all_gather_obj(self.local_step(switch, clock)))
