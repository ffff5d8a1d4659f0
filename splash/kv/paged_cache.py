"""Per-layer paged pools for the MLA latent KV (c_kv, k_rope and, when quantised, their scales).

A slot is `physical_block * block_size + offset`. Blocks pack to raw bytes exactly as stored, so a switch moves
them verbatim. Each layer has its own KV dtype: a switch between dtypes converts layer by layer (`convert_layer`,
block ids unchanged), so mid-handoff some layers are in the destination's format and later ones in the source's.

DSA indexer keys (`index_parts` vectors of index_dim per token, each quantised on its own: GLM-5.3-Flash's KPool
keeps key and gate logits) live in the same blocks and format family as the latent, so they move and convert with
it. On a GPU (`fused`) a bf16 layer stores latent and rope key in one [blocks, page, d_c + d_r] tensor, the buffer
trtllm-gen MLA and AITER read as is; `ckv`/`kpe` are views of it. Other layers keep separate contiguous tensors
(on the CPU bf16 GEMMs over strided views measured 1.7x slower, docs/benchmarks.md). With `rope_fp8` (FlashInfer's
FP8 MLA on SM90) an fp8_e4m3 layer stores its rope key in e4m3 at quant.ROPE_FP8_SCALE.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from splash.kv import quant
from splash.layouts.memory import CONVERT_CHUNK_SLOTS, ROPE_FP8_DTYPES

FUSED_DTYPES = ("bfloat16",)   # KV dtypes stored as one [blocks, page, d_c + d_r] tensor per layer (vendor format)


class PagedLatentCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int,
                 kv_dtype: str = "float32", device: str | torch.device = "cpu", index_dim: int = 0,
                 index_layers: Sequence[int] = (), index_parts: int = 1, fused: bool | None = None,
                 rope_fp8: bool = False):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_lora_rank, self.rope_dim, self.device = kv_lora_rank, rope_dim, device
        self.index_dim, self.index_layers = index_dim, frozenset(index_layers) if index_dim else frozenset()
        self.index_parts = index_parts
        self.fuse = torch.device(device).type != "cpu" if fused is None else fused
        self.rope_fp8 = rope_fp8   # fp8_e4m3 layers store the rope key in e4m3 (quant.ROPE_FP8_SCALE), not bf16
        self.layer_dtypes = [kv_dtype] * num_layers
        parts = [self._alloc(kv_dtype, layer) for layer in range(num_layers)]
        self.ckv = [p[0] for p in parts]
        self.kpe = [p[1] for p in parts]
        self.scale: list[torch.Tensor | None] = [p[2] for p in parts]   # None for an unquantised layer
        self.ikey: list[torch.Tensor | None] = [p[3] for p in parts]    # None for a layer without an indexer
        self.iscale: list[torch.Tensor | None] = [p[4] for p in parts]  # indexer key scales (quantised only)
        self.fused: list[torch.Tensor | None] = [p[5] for p in parts]   # [blocks, page, d_c + d_r] or None

    def _alloc(self, kv_dtype: str, layer: int) -> tuple[torch.Tensor | None, ...]:
        """(ckv, kpe, scale, ikey, iscale, fused) of one layer stored as `kv_dtype`."""
        lat_dt, rope_dt = quant.storage_dtypes(kv_dtype)
        if self.rope_fp8 and kv_dtype in ROPE_FP8_DTYPES:   # the memory model counts the same bytes
            rope_dt = quant.ROPE_FP8
        shape, dev, q = (self.num_blocks, self.block_size), self.device, quant.is_quantized(kv_dtype)
        dc = self.kv_lora_rank
        fused = None
        if self.fuse and kv_dtype in FUSED_DTYPES:
            fused = torch.zeros(*shape, dc + self.rope_dim, dtype=lat_dt, device=dev)
            ckv, kpe = fused[..., :dc], fused[..., dc:]
        else:
            ckv = torch.zeros(*shape, dc, dtype=lat_dt, device=dev)
            kpe = torch.zeros(*shape, self.rope_dim, dtype=rope_dt, device=dev)
        scale = torch.zeros(*shape, quant.num_groups(self.kv_lora_rank), dtype=torch.float32, device=dev) if q else None
        ikey = iscale = None
        if layer in self.index_layers:
            parts = self.index_parts
            ikey = torch.zeros(*shape, parts * self.index_dim, dtype=lat_dt, device=dev)
            if q:
                iscale = torch.zeros(*shape, parts * quant.num_groups(self.index_dim), dtype=torch.float32,
                                     device=dev)
        return ckv, kpe, scale, ikey, iscale, fused

    # ---- formats -----------------------------------------------------------------------------------------
    def kv_dtype_of(self, layer: int) -> str:
        return self.layer_dtypes[layer]

    @property
    def kv_dtype(self) -> str:
        """The pool's KV dtype, or "mixed" while a handoff has converted only some layers."""
        kinds = set(self.layer_dtypes)
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def clear(self) -> None:
        """Zero every block: after a weight update nothing the old weights wrote may reach a later request, not
        even through a block's slots past its tokens, which attention weighs 0 (and 0 × NaN is NaN)."""
        for layer in range(self.num_layers):
            for part in self._parts(layer):
                part.zero_()

    # ---- sizes -------------------------------------------------------------------------------------------
    def _latent(self, layer: int) -> list[torch.Tensor]:
        parts = [self.ckv[layer], self.kpe[layer]]
        if self.scale[layer] is not None:
            parts.append(self.scale[layer])
        return parts

    def _index(self, layer: int) -> list[torch.Tensor]:
        return [t for t in (self.ikey[layer], self.iscale[layer]) if t is not None]

    def _parts(self, layer: int) -> list[torch.Tensor]:
        """Every tensor of the layer's blocks (a fused layer's latent and rope are its one fused tensor)."""
        latent = [self.fused[layer]] if self.fused[layer] is not None else self._latent(layer)
        return latent + self._index(layer)

    def block_bytes(self, layer: int = 0) -> int:
        """Bytes of one block in one layer (data + scales), in that layer's current format."""
        return sum(p[0].numel() * p.element_size() for p in self._parts(layer)) if self.num_layers else 0

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for layer in range(self.num_layers) for p in self._parts(layer))

    # ---- token access ------------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store new tokens' latent [n, dc] and rope key [n, dr] at the given slots."""
        _encode(self._latent(layer), self.layer_dtypes[layer], slots, c_kv, k_pe)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 latent [..., dc] and rope key [..., dr] at `slots` (any shape)."""
        return _decode(self._latent(layer), slots)

    def write_index(self, layer: int, slots: torch.Tensor, keys: torch.Tensor) -> None:
        """Store new tokens' indexer keys [n, index_parts × index_dim] at `slots` (a layer that runs an indexer)."""
        _store(self._index(layer), self.layer_dtypes[layer], slots, keys, self.index_parts)

    def read_index(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """fp32 indexer keys [..., index_parts × index_dim] at `slots` (any shape)."""
        return _load(self._index(layer), slots, self.index_parts)

    # ---- format conversion -------------------------------------------------------------------------------
    def convert_layer(self, layer: int, kv_dtype: str, blocks: Sequence[int] | None = None) -> bool:
        """Re-store `layer` in `kv_dtype` through fp32, keeping block ids and the contents of `blocks` (default:
        all; the others start zeroed). Old and new tensors of this one layer coexist (the transient a switch
        budgets for). False when the layer is already in `kv_dtype`."""
        quant.storage_dtypes(kv_dtype)  # validates the name
        if kv_dtype == self.layer_dtypes[layer]:
            return False
        old, new = self._latent(layer), self._alloc(kv_dtype, layer)
        old_idx, new_idx = self._index(layer), [p for p in new[3:5] if p is not None]
        new_parts = [p for p in new[:3] if p is not None]
        dev = old[0].device
        ids = (torch.arange(self.num_blocks, device=dev) if blocks is None
               else torch.as_tensor(list(blocks), dtype=torch.long, device=dev))
        per = max(1, CONVERT_CHUNK_SLOTS // self.block_size)
        offs = torch.arange(self.block_size, device=dev)
        for i in range(0, len(ids), per):
            slots = (ids[i:i + per, None] * self.block_size + offs).reshape(-1)
            c, k = _decode(old, slots)
            _encode(new_parts, kv_dtype, slots, c, k)
            if old_idx:
                _store(new_idx, kv_dtype, slots, _load(old_idx, slots, self.index_parts), self.index_parts)
        (self.ckv[layer], self.kpe[layer], self.scale[layer], self.ikey[layer], self.iscale[layer],
         self.fused[layer]) = new
        self.layer_dtypes[layer] = kv_dtype
        return True

    # ---- block transfer ----------------------------------------------------------------------------------
    def pack_blocks(self, layer: int, phys: list[int]) -> torch.Tensor:
        """Raw bytes of the given blocks in the layer's current format: uint8 [len(phys), block_bytes(layer)]."""
        idx = torch.as_tensor(phys, dtype=torch.long, device=self.device)
        rows = [p[idx].reshape(len(phys), -1).contiguous().view(torch.uint8) for p in self._parts(layer)]
        return torch.cat(rows, dim=1) if rows else torch.empty(0, 0, dtype=torch.uint8, device=self.device)

    def unpack_blocks(self, layer: int, phys: list[int], data: torch.Tensor) -> None:
        """Inverse of pack_blocks: write raw bytes (in the layer's current format) into the given blocks."""
        idx = torch.as_tensor(phys, dtype=torch.long, device=self.device)
        off = 0
        for p in self._parts(layer):
            width = p[0].numel() * p.element_size()
            chunk = data[:, off:off + width].contiguous().view(p.dtype).view(len(phys), *p.shape[1:])
            p[idx] = chunk
            off += width


def _encode(parts: list[torch.Tensor], kv_dtype: str, slots: torch.Tensor, c_kv: torch.Tensor,
            k_pe: torch.Tensor) -> None:
    """Write fp latent/rope rows at `slots` of one layer's tensors [ckv, kpe(, scale)] stored as `kv_dtype`."""
    _store([parts[0], *parts[2:]], kv_dtype, slots, c_kv)
    kpe = _flat(parts[1])
    kpe[slots] = quant.quantize_rope(k_pe) if kpe.dtype == quant.ROPE_FP8 else k_pe.to(kpe.dtype)


def _decode(parts: list[torch.Tensor], slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 latent and rope rows at `slots` (any shape) of one layer's tensors [ckv, kpe(, scale)]."""
    kpe = _flat(parts[1]).index_select(0, slots.reshape(-1)).view(*slots.shape, parts[1].shape[-1])
    return _load([parts[0], *parts[2:]], slots), quant.dequantize_rope(kpe)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[blocks, block_size, width] -> [slots, width] (explicit sizes: width may be 0, e.g. NoPE's rope key)."""
    return t.view(t.shape[0] * t.shape[1], t.shape[-1])


def _store(parts: list[torch.Tensor], kv_dtype: str, slots: torch.Tensor, x: torch.Tensor, n_vec: int = 1) -> None:
    """Write fp rows x [n, n_vec × d] at `slots` of one layer's [values(, scales)] stored as `kv_dtype` (the
    latent, or indexer keys: each of a token's n_vec vectors quantised on its own)."""
    vals = _flat(parts[0])
    if quant.is_quantized(kv_dtype):
        n = x.shape[0]
        q, s = quant.quantize(x.reshape(n * n_vec, x.shape[-1] // n_vec), kv_dtype)
        scales = _flat(parts[1])
        vals[slots] = q.view(n, vals.shape[-1])
        scales[slots] = s.view(n, scales.shape[-1])
    else:
        vals[slots] = x.to(vals.dtype)


def _load(parts: list[torch.Tensor], slots: torch.Tensor, n_vec: int = 1) -> torch.Tensor:
    """fp32 rows [..., n_vec × d] at `slots` (any shape) of one layer's [values(, scales)]."""
    flat, width = slots.reshape(-1), parts[0].shape[-1]  # index_select on flat slots: several times faster
    vals = _flat(parts[0]).index_select(0, flat).view(*slots.shape, n_vec, width // n_vec)
    if len(parts) > 1:
        vals = quant.dequantize(vals, _flat(parts[1]).index_select(0, flat).view(*slots.shape, n_vec, -1))
    return vals.float().reshape(*slots.shape, width)
