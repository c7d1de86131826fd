"""DFlash2's grouped dynamic causal convolution over a block's positions, wrapped around each layer's attention and MLP.

    out_t = sum_j (base[j] + dyn_t[j]) * x_{t-j},   j = 0 .. taps-1

base [taps, H] is learned per channel; dyn_t [taps, G] is projected from the sublayer's normed input at row t and
shared by the H / G channels of each group. x_{t-j} is zero before the block's first row: the convolution never reaches
into the previous block or the context (context rows enter the layers only as attention K/V, never convolved). One
projection gives two coefficient sets: the first convolves the sublayer's input (`prepare`), the second its output
(`finish`); base_kernel [2, taps, H] holds their bases in that order.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class DynamicConv(nn.Module):
    """Parameter names are the checkpoint's: `base_kernel` [2, taps, H], `kernel_projection.weight` [2*taps*G, H]."""

    def __init__(self, hidden: int, taps: int, group: int) -> None:
        super().__init__()
        assert hidden % group == 0, "validated in core/draft/config.py"
        self.taps, self.group, self.groups = taps, group, hidden // group
        # identity at tap 0 on both sides: a fresh convolution passes its sublayer through unchanged
        base = torch.zeros(2, taps, hidden)
        base[:, 0] = 1.0
        self.base_kernel = nn.Parameter(base)
        self.kernel_projection = nn.Linear(hidden, 2 * taps * self.groups, bias=False)

    def prepare(self, x: Tensor, block: int) -> tuple[Tensor, Tensor]:
        """x [N, Q, H] the sublayer's normed input, Q rows = whole blocks of `block` rows -> (x convolved [N, Q, H],
        the coefficients `finish` applies to the sublayer's output [N, Q, taps, G])."""
        dyn = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return self._convolve(x, dyn[..., 0, :, :], 0, block), dyn[..., 1, :, :]

    def finish(self, y: Tensor, dyn: Tensor, block: int) -> Tensor:
        """y [N, Q, H] the sublayer's output, dyn [N, Q, taps, G] from `prepare` -> [N, Q, H]."""
        return self._convolve(y, dyn, 1, block)

    def _convolve(self, x: Tensor, dyn: Tensor, side: int, block: int) -> Tensor:
        n, q, hidden = x.shape
        assert q % block == 0, "rows are whole blocks"
        # [N, blocks, block rows, G, channels per group]: the shift runs along the block rows only
        xg = x.view(n, q // block, block, self.groups, self.group)
        coeff = self.base_kernel[side].to(x.dtype).view(self.taps, self.groups, self.group)
        coeff = coeff + dyn.reshape(n, q // block, block, self.taps, self.groups, 1)
        out = coeff[:, :, :, 0] * xg
        for j in range(1, min(self.taps, block)):  # (taps past the block's length only ever see zeros)
            earlier = F.pad(xg[:, :, :-j], (0, 0, 0, 0, j, 0))  # x_{t-j}, zero before the block's first row
            out = out + coeff[:, :, :, j] * earlier
        return out.view(n, q, hidden)
