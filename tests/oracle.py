"""Independent oracles written with numpy and plain Python (not the torch reference)."""

import numpy as np

M32 = 0xFFFFFFFF


def mix32(x):
    x &= M32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    x ^= x >> 16
    return x


def key(seed, counter):
    k = mix32((counter >> 32) ^ 0x9E3779B9)
    k = mix32((counter & M32) ^ k)
    k = mix32((seed >> 32) ^ k)
    return mix32((seed & M32) ^ k)


def uniforms(n, seed, counter):
    k = key(seed, counter)
    return np.array([(mix32((i & M32) ^ k) >> 8) * 2.0**-24 for i in range(n)], dtype=np.float32)


def quantize(x32, block, rounding="nearest", seed=0, counter=0):
    """Per-block loop over a float32 numpy array -> (codes int8, scales float32)."""
    x32 = np.asarray(x32, dtype=np.float32)
    n = x32.size
    nb = -(-n // block)
    codes = np.zeros(n, dtype=np.int8)
    scales = np.zeros(nb, dtype=np.float32)
    u = uniforms(n, seed, counter) if rounding == "stochastic" else None
    with np.errstate(all="ignore"):
        for b in range(nb):
            blk = x32[b * block:(b + 1) * block]
            if not np.all(np.isfinite(blk)):
                scales[b] = np.float32("nan")
                continue
            m = np.float32(np.max(np.abs(blk)))
            if m == 0:
                continue
            y = (blk / m).astype(np.float32) * np.float32(127)
            if rounding == "nearest":
                c = np.rint(y)
            else:
                c = np.floor((y + u[b * block:(b + 1) * block]).astype(np.float32))
            codes[b * block:(b + 1) * block] = np.clip(c, -127, 127).astype(np.int8)
            scales[b] = np.float32(m / np.float32(127))
    return codes, scales


def topk_indices(a, k):
    """Indices of the k largest |a| (NaN largest, ties by lower index), ascending."""
    a = np.abs(np.asarray(a, dtype=np.float64))
    keyv = np.where(np.isnan(a), np.inf, a)
    nan_first = np.isnan(a).astype(np.int8)
    order = np.lexsort((np.arange(a.size), -keyv, -nan_first))
    return np.sort(order[:k])
