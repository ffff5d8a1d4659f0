"""Per-layer paged pools for the MLA latent KV (c_kv, k_rope and, when quantised, their scales).

A slot is `physical_block * block_size + offset`. Blocks can be packed to raw bytes (data + scales, exactly as
stored) so a layout switch moves them verbatim.
"""
from __future__ import annotations

import torch

from splash.kv import quant


class PagedLatentCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_lora_rank: int, rope_dim: int,
                 kv_dtype: str = "float32", device: str | torch.device = "cpu"):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.kv_lora_rank, self.rope_dim, self.kv_dtype = kv_lora_rank, rope_dim, kv_dtype
        lat_dt, rope_dt = quant.storage_dtypes(kv_dtype)
        self.quantized = quant.is_quantized(kv_dtype)
        shape = (num_blocks, block_size)
        self.ckv = [torch.zeros(*shape, kv_lora_rank, dtype=lat_dt, device=device) for _ in range(num_layers)]
        self.kpe = [torch.zeros(*shape, rope_dim, dtype=rope_dt, device=device) for _ in range(num_layers)]
        g = quant.num_groups(kv_lora_rank)
        self.scale = ([torch.zeros(*shape, g, dtype=torch.float32, device=device) for _ in range(num_layers)]
                      if self.quantized else None)

    # ---- sizes -------------------------------------------------------------------------------------------
    def _parts(self, layer: int) -> list[torch.Tensor]:
        parts = [self.ckv[layer], self.kpe[layer]]
        if self.scale is not None:
            parts.append(self.scale[layer])
        return parts

    def block_bytes(self) -> int:
        """Bytes of one block in one layer (data + scales)."""
        return sum(p[0].numel() * p.element_size() for p in self._parts(0)) if self.num_layers else 0

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for layer in range(self.num_layers) for p in self._parts(layer))

    # ---- token access ------------------------------------------------------------------------------------
    def write(self, layer: int, slots: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor) -> None:
        """Store new tokens' latent [n, dc] and rope key [n, dr] at the given slots."""
        ckv = self.ckv[layer].view(-1, self.kv_lora_rank)
        kpe = self.kpe[layer].view(-1, self.rope_dim)
        if self.quantized:
            q, s = quant.quantize(c_kv, self.kv_dtype)
            ckv[slots] = q
            self.scale[layer].view(-1, s.shape[-1])[slots] = s
        else:
            ckv[slots] = c_kv.to(ckv.dtype)
        kpe[slots] = k_pe.to(kpe.dtype)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 latent [..., dc] and rope key [..., dr] at `slots` (any shape)."""
        flat = slots.reshape(-1)  # index_select on flat slots is several times faster than advanced indexing

        def take(t: torch.Tensor, width: int) -> torch.Tensor:
            return t.view(-1, width).index_select(0, flat).view(*slots.shape, width)

        ckv = take(self.ckv[layer], self.kv_lora_rank)
        kpe = take(self.kpe[layer], self.rope_dim).float()
        if self.quantized:
            return quant.dequantize(ckv, take(self.scale[layer], self.scale[layer].shape[-1])), kpe
        return ckv.float(), kpe

    # ---- block transfer ----------------------------------------------------------------------------------
    def pack_blocks(self, layer: int, phys: list[int]) -> torch.Tensor:
        """Raw bytes of the given blocks: uint8 [len(phys), block_bytes]."""
        idx = torch.as_tensor(phys, dtype=torch.long)
        rows = [p[idx].reshape(len(phys), -1).contiguous().view(torch.uint8) for p in self._parts(layer)]
        return torch.cat(rows, dim=1) if rows else torch.empty(0, 0, dtype=torch.uint8)

    def unpack_blocks(self, layer: int, phys: list[int], data: torch.Tensor) -> None:
        """Inverse of pack_blocks: write raw bytes into the given physical blocks."""
        idx = torch.as_tensor(phys, dtype=torch.long)
        off = 0
        for p in self._parts(layer):
            width = p[0].numel() * p.element_size()
            chunk = data[:, off:off + width].contiguous().view(p.dtype).view(len(phys), *p.shape[1:])
            p[idx] = chunk
            off += width
