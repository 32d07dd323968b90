"""Reference models for tests, benchmarks and examples: plain PyTorch modules,
written with no knowledge of domainpar, that run unchanged on DomainTensors.

``UNet3d``: a 3-D UNet with the layers scientific surrogates use: conv +
GroupNorm + GELU blocks, strided-conv down-sampling, transposed-conv
up-sampling, trilinear up-sampling on the shallowest path, skip connections
by concatenation, and BatchNorm in the bottleneck. Any spatial size works
(62, 63, 64 ...): the up-sampling targets the skip's size.
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
