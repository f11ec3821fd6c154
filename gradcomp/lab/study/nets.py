"""The workloads' models (:mod:`gradcomp.lab.study.workloads`): a small CNN, the
CIFAR variant of ResNet-18 and a character-level decoder-only transformer."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["SmallCNN", "resnet18_cifar", "CharGPT", "ResNetCIFAR"]


class SmallCNN(nn.Sequential):
    """LeNet-style CNN for ``(B, 1, 28, 28)`` float32 images -> ``(B, classes)`` logits:
    conv5x5(16) - ReLU - maxpool2 - conv5x5(32) - ReLU - maxpool2 - dense 128 - ReLU -
    dense; 215,370 parameters for 10 classes."""

    def __init__(self, num_classes: int = 10):
        super().__init__(
            nn.Conv2d(1, 16, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 5, padding=2), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(32 * 7 * 7, 128), nn.ReLU(), nn.Linear(128, num_classes))


class _BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                          nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class ResNetCIFAR(nn.Module):
    """ResNet for ``(B, 3, 32, 32)`` images: a 3x3 stem of 64 channels without
    max-pooling, four stages of basic blocks (64, 128, 256, 512 channels),
    global average pooling, one dense layer (He et al. 2016, "Deep Residual
    Learning for Image Recognition", in the CIFAR form common in the
    gradient-compression literature)."""

    def __init__(self, blocks=(2, 2, 2, 2), num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU())
        layers, cin = [], 64
        for i, n in enumerate(blocks):
            cout = 64 * 2 ** i
            for j in range(n):
                layers.append(_BasicBlock(cin, cout, 2 if (j == 0 and i > 0) else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        out = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(out, 1), 1))


def resnet18_cifar(num_classes: int = 10) -> ResNetCIFAR:
    """ResNet-18, CIFAR variant: 11,173,962 parameters for 10 classes."""
    return ResNetCIFAR((2, 2, 2, 2), num_classes)


class _Block(nn.Module):
    """Pre-norm transformer block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """Decoder-only transformer (GPT-2 layout: token and learned position
    embeddings, pre-norm blocks, a final LayerNorm and an untied output layer;
    Radford et al. 2019) for ``(B, T)`` int64 character ids, ``T <= block``,
    -> ``(B, T, vocab)`` float32 next-character logits.

    Args:
        vocab: characters in the vocabulary; block: longest context.
        dim, layers, heads: width, depth and attention heads (``dim % heads == 0``).
    """

    def __init__(self, vocab: int, block: int, dim: int = 128, layers: int = 2, heads: int = 4):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim ({dim}) must be a multiple of heads ({heads})")
        self.block = block
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(block, dim)
        self.blocks = nn.Sequential(*[_Block(dim, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block:
            raise ValueError(f"sequence of {t} tokens exceeds the block size {self.block}")
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.ln(self.blocks(x)))
