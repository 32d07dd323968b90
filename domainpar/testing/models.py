"""Reference models for tests, benchmarks and examples: plain PyTorch modules,
written with no knowledge of domainpar, that run unchanged on DomainTensors.

``UNet3d``: a 3-D UNet with the layers scientific surrogates use: conv +
GroupNorm + GELU blocks, strided-conv down-sampling, transposed-conv
up-sampling, trilinear up-sampling on the shallowest path, skip connections
by concatenation, and BatchNorm in the bottleneck. Any spatial size works
(62, 63, 64 ...): the up-sampling targets the skip's size.

``ViT2d``: a small vision transformer over the patches of a 2-D field, in the
way such code is usually written: a strided conv cuts patches, the patch grid
is flattened into a token sequence (``flatten(2).transpose(1, 2)``), learned
positional embeddings are added, and pre-norm blocks alternate a hand-written
multi-head attention (qkv linear, head split, F.scaled_dot_product_attention)
with ``nn.MultiheadAttention``; a transposed conv turns tokens back into a field.

``FNO2d``: a 2-D Fourier neural operator: channel lifting, spectral layers
(rfft2, the low ``modes`` of both signs along H and the first ``modes`` along
W mixed by complex weights with einsum, zero-filled back to the full spectrum,
irfft2) plus a pointwise conv path, GELU, and a projection.

``ResNet3d``: a 3-D residual network without normalization (stem conv,
residual blocks ``x + conv(gelu(conv(x)))``, a 1x1x1 head), the kind of
chain whose halos ``DomainParallel(..., fuse_halos=True)`` exchanges once per
block instead of once per conv.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ConvBlock(nn.Module):
    """conv 3x3x3 -> GroupNorm -> GELU."""

    def __init__(self, cin: int, cout: int, groups: int = 2):
        super().__init__()
        self.conv = nn.Conv3d(cin, cout, 3, padding=1)
        self.norm = nn.GroupNorm(groups, cout)
        self.act = nn.GELU()

    def forward(self, x):
        """Collective when ``x`` is a DomainTensor (the conv's halos, the norm's
        statistics). Conv, norm, activation."""
        return self.act(self.norm(self.conv(x)))


class UNet3d(nn.Module):
    """A ``levels``-level 3-D UNet; level ``l`` has ``width * 2**l`` channels."""

    def __init__(self, in_channels: int = 2, out_channels: int = 2, width: int = 4,
                 levels: int = 4):
        super().__init__()
        ch = [width * 2 ** level for level in range(levels)]
        self.enter = ConvBlock(in_channels, ch[0])
        self.down = nn.ModuleList(nn.Conv3d(ch[i], ch[i + 1], 3, stride=2, padding=1)
                                  for i in range(levels - 1))
        self.encode = nn.ModuleList(ConvBlock(ch[i + 1], ch[i + 1]) for i in range(levels - 1))
        self.bottleneck = nn.Sequential(nn.BatchNorm3d(ch[-1]), nn.GELU())
        # Up from level i + 1 to level i: transposed convs, except the shallowest
        # path, which up-samples trilinearly and mixes channels with a 1x1x1 conv.
        self.up = nn.ModuleList(
            nn.Conv3d(ch[1], ch[0], 1) if i == 0 else
            nn.ConvTranspose3d(ch[i + 1], ch[i], 3, stride=2, padding=1)
            for i in range(levels - 1))
        self.decode = nn.ModuleList(ConvBlock(2 * ch[i], ch[i]) for i in range(levels - 1))
        self.head = nn.Conv3d(ch[0], out_channels, 1)

    def forward(self, x):
        """Collective when ``x`` is a DomainTensor. Encoder, bottleneck, decoder with
        skip connections."""
        skips = [self.enter(x)]
        for down, encode in zip(self.down, self.encode):
            skips.append(encode(down(skips[-1])))
        h = self.bottleneck(skips.pop())
        for i in reversed(range(len(self.up))):
            skip = skips.pop()
            if i == 0:
                h = F.interpolate(h, size=skip.shape[2:], mode="trilinear", align_corners=False)
                h = self.up[i](h)
            else:
                h = self.up[i](h, output_size=skip.shape[2:])
            h = self.decode[i](torch.cat([h, skip], dim=1))
        return self.head(h)


class ResidualBlock(nn.Module):
    """``x + conv(gelu(conv(x)))``, 3x3x3 convs, no normalization."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv3d(channels, channels, 3, padding=1)
        self.act = nn.GELU()
        self.conv2 = nn.Conv3d(channels, channels, 3, padding=1)

    def forward(self, x):
        """Collective when ``x`` is a DomainTensor (the convs' halos). The block."""
        return x + self.conv2(self.act(self.conv1(x)))


class ResNet3d(nn.Module):
    """A stem conv to ``width`` channels, ``blocks`` residual blocks, a 1x1x1 head."""

    def __init__(self, in_channels: int = 2, out_channels: int = 2, width: int = 8,
                 blocks: int = 3):
        super().__init__()
        self.stem = nn.Conv3d(in_channels, width, 3, padding=1)
        self.blocks = nn.Sequential(*(ResidualBlock(width) for _ in range(blocks)))
        self.head = nn.Conv3d(width, out_channels, 1)

    def forward(self, x):
        """Collective when ``x`` is a DomainTensor. Stem, residual blocks, head."""
        return self.head(self.blocks(self.stem(x)))


# -- a vision transformer over patches ------------------------------------------------------------
class SelfAttention(nn.Module):
    """Multi-head self-attention written out: qkv projection, head split, SDPA."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        """Collective when ``x`` is sharded along the tokens (attention over all of them).
        Multi-head self-attention of ``x`` (B, N, D)."""
        b, n, d = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, n, d))


class TransformerBlock(nn.Module):
    """Pre-norm attention and MLP, each with a residual."""

    def __init__(self, dim: int, heads: int, torch_mha: bool):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.torch_mha = torch_mha
        self.attn = (nn.MultiheadAttention(dim, heads, batch_first=True) if torch_mha
                     else SelfAttention(dim, heads))
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        """Collective when ``x`` is sharded along the tokens. Pre-norm attention and MLP,
        each with a residual."""
        h = self.norm1(x)
        h = self.attn(h, h, h, need_weights=False)[0] if self.torch_mha else self.attn(h)
        x = x + h
        return x + self.mlp(self.norm2(x))


class ViT2d(nn.Module):
    """Patches of a ``size`` field -> tokens -> ``depth`` transformer blocks -> a
    field again (a surrogate's output, same shape as the input's spatial dims)."""

    def __init__(self, size: tuple[int, int], in_channels: int = 1, out_channels: int = 1,
                 patch: int = 8, dim: int = 32, heads: int = 4, depth: int = 2):
        super().__init__()
        self.grid = (size[0] // patch, size[1] // patch)
        self.embed = nn.Conv2d(in_channels, dim, patch, stride=patch)
        self.pos = nn.Parameter(0.02 * torch.randn(1, self.grid[0] * self.grid[1], dim))
        self.blocks = nn.ModuleList(TransformerBlock(dim, heads, torch_mha=i % 2 == 1)
                                    for i in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.unembed = nn.ConvTranspose2d(dim, out_channels, patch, stride=patch)

    def forward(self, x):
        """Collective when ``x`` is a DomainTensor. Patch embedding, transformer blocks,
        and the tokens back to an image."""
        t = self.embed(x)                          # (B, D, h, w)
        b, d, h, w = t.shape
        t = t.flatten(2).transpose(1, 2) + self.pos  # (B, h*w, D): tokens in row-major order
        for block in self.blocks:
            t = block(t)
        t = self.norm(t).transpose(1, 2).reshape(b, d, h, w)
        return self.unembed(t)


# -- a Fourier neural operator ----------------------------------------------------------------
class SpectralConv2d(nn.Module):
    """Mixes channels on the lowest ``modes`` frequencies of both signs along H
    and the first ``modes`` along W (the rfft half-spectrum); drops the rest."""

    def __init__(self, cin: int, cout: int, modes: int):
        super().__init__()
        self.modes = modes
        scale = 1.0 / (cin * cout)
        # Complex weights stored as (real, imag) pairs, so that .double() converts them.
        self.w_pos = nn.Parameter(scale * torch.randn(cin, cout, modes, modes, 2))
        self.w_neg = nn.Parameter(scale * torch.randn(cin, cout, modes, modes, 2))

    def forward(self, x):
        """Collective when ``x`` is a DomainTensor (the FFTs). The spectral convolution:
        the lowest ``modes`` frequencies mixed by the learned weights."""
        h, w = x.shape[-2:]
        m = self.modes
        x_ft = torch.fft.rfft2(x)
        w_pos, w_neg = torch.view_as_complex(self.w_pos), torch.view_as_complex(self.w_neg)
        low = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, :m, :m], w_pos)
        high = torch.einsum("bixy,ioxy->boxy", x_ft[:, :, -m:, :m], w_neg)
        # The full spectrum again: zeros between the two bands and past mode m along W.
        out_ft = torch.cat([F.pad(low, (0, 0, 0, h - 2 * m)), high], dim=-2)
        out_ft = F.pad(out_ft, (0, w // 2 + 1 - m))
        return torch.fft.irfft2(out_ft, s=(h, w))


class FNO2d(nn.Module):
    """Lift (1x1 conv) -> ``layers`` x (spectral conv + 1x1 conv, GELU) -> project."""

    def __init__(self, in_channels: int = 1, out_channels: int = 1, width: int = 8,
                 modes: int = 12, layers: int = 4):
        super().__init__()
        self.lift = nn.Conv2d(in_channels, width, 1)
        self.spectral = nn.ModuleList(SpectralConv2d(width, width, modes) for _ in range(layers))
        self.pointwise = nn.ModuleList(nn.Conv2d(width, width, 1) for _ in range(layers))
        self.project = nn.Sequential(nn.Conv2d(width, 2 * width, 1), nn.GELU(),
                                     nn.Conv2d(2 * width, out_channels, 1))

    def forward(self, x):
        """Collective when ``x`` is a DomainTensor. Lift, spectral and pointwise layers,
        project."""
        h = self.lift(x)
        for i, (spectral, pointwise) in enumerate(zip(self.spectral, self.pointwise)):
            h = spectral(h) + pointwise(h)
            if i < len(self.spectral) - 1:
                h = F.gelu(h)
        return self.project(h)
