"""An independent reference for ggml's block formats, written from the C reference
(`dequantize_row_*` in ggml-quants.c) as plain per-block loops, to check gguf-py's vectorised
dequantization that weld uses. Slow; for a few blocks only.

Each function takes the raw bytes of n blocks as uint8 [n, type_size] and returns float32 [n * block].
"""

from __future__ import annotations

import numpy as np

BLOCKS = {  # name -> (elements per block, bytes per block)
    "Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
    "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210),
    "MXFP4": (32, 17), "IQ4_NL": (32, 18), "IQ4_XS": (256, 136),
}
# ggml's kvalues_iq4nl
_IQ4 = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
# ggml's kvalues_mxfp4: the e2m1 values doubled, by 4-bit code
_MXFP4 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _f16(b: np.ndarray) -> np.float32:
    return np.float32(b[:2].copy().view(np.float16)[0])


def _q8_0(b):
    d = _f16(b[0:2])
    return [d * np.float32(q) for q in b[2:34].view(np.int8)]


def _q4_0(b):
    d, qs = _f16(b[0:2]), b[2:18]
    return [d * np.float32((int(q) & 0xF) - 8) for q in qs] + [d * np.float32((int(q) >> 4) - 8) for q in qs]


def _q4_1(b):
    d, m, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:20]
    return [d * np.float32(q & 0xF) + m for q in qs] + [d * np.float32(q >> 4) + m for q in qs]


def _q5(d, m, qh, qs, offset):
    qh = int(qh.copy().view("<u4")[0])
    lo, hi = [], []
    for j in range(16):
        xh0 = ((qh >> j) << 4) & 0x10
        xh1 = (qh >> (j + 12)) & 0x10
        lo.append(d * np.float32(((int(qs[j]) & 0xF) | xh0) - offset) + m)
        hi.append(d * np.float32(((int(qs[j]) >> 4) | xh1) - offset) + m)
    return lo + hi


def _q5_0(b):
    return _q5(_f16(b[0:2]), np.float32(0), b[2:6], b[6:22], 16)


def _q5_1(b):
    return _q5(_f16(b[0:2]), _f16(b[2:4]), b[4:8], b[8:24], 0)


def _scale_min_k4(j: int, q: np.ndarray) -> tuple[int, int]:
    q = [int(x) for x in q]
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


def _q2_k(b):
    scales, qs, d, dmin = b[0:16], b[16:80], _f16(b[80:82]), _f16(b[82:84])
    y, i = [], 0
    for n in range(2):  # two halves of 128 values; each 32 bytes of qs hold 4 planes of 2 bits
        q = qs[32 * n:32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                sc = int(scales[i])
                i += 1
                dl, ml = d * np.float32(sc & 0xF), dmin * np.float32(sc >> 4)
                y += [dl * np.float32((int(q[half + l]) >> shift) & 3) - ml for l in range(16)]
    return y


def _q3_k_scales(raw: np.ndarray) -> list[int]:
    """12 bytes -> 16 signed 6-bit scales, as ggml's kmask1/kmask2 shuffle on four uint32s."""
    aux = [int(v) for v in raw.copy().view("<u4")] + [0]
    kmask1, kmask2 = 0x03030303, 0x0F0F0F0F
    tmp = aux[2]
    aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4)
    aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4)
    aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4)
    aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4)
    return [int(v) for v in np.array(aux, dtype="<u4").view(np.int8)]


def _q3_k(b):
    hmask, qs, scales, d = b[0:32], b[32:96], _q3_k_scales(b[96:108]), _f16(b[108:110])
    y, i, m = [], 0, 1
    for n in range(2):
        q = qs[32 * n:32 * n + 32]
        for shift in (0, 2, 4, 6):
            for half in (0, 16):
                dl = d * np.float32(scales[i] - 32)
                i += 1
                y += [dl * np.float32(((int(q[half + l]) >> shift) & 3) - (0 if hmask[half + l] & m else 4))
                      for l in range(16)]
            m <<= 1
    return y


def _q4_k(b):
    d, dmin, scales, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:144]
    y = []
    for j in range(4):  # 4 groups of 64 values, each two sub-blocks of 32 with 6-bit scale/min
        q = qs[32 * j:32 * j + 32]
        sc, m = _scale_min_k4(2 * j, scales)
        d1, m1 = d * np.float32(sc), dmin * np.float32(m)
        sc, m = _scale_min_k4(2 * j + 1, scales)
        d2, m2 = d * np.float32(sc), dmin * np.float32(m)
        y += [d1 * np.float32(x & 0xF) - m1 for x in q]
        y += [d2 * np.float32(x >> 4) - m2 for x in q]
    return y


def _q5_k(b):
    d, dmin, scales, qh, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:16], b[16:48], b[48:176]
    y = []
    u1, u2 = 1, 2
    for j in range(4):
        ql = qs[32 * j:32 * j + 32]
        sc, m = _scale_min_k4(2 * j, scales)
        d1, m1 = d * np.float32(sc), dmin * np.float32(m)
        sc, m = _scale_min_k4(2 * j + 1, scales)
        d2, m2 = d * np.float32(sc), dmin * np.float32(m)
        y += [d1 * np.float32((int(ql[l]) & 0xF) + (16 if qh[l] & u1 else 0)) - m1 for l in range(32)]
        y += [d2 * np.float32((int(ql[l]) >> 4) + (16 if qh[l] & u2 else 0)) - m2 for l in range(32)]
        u1, u2 = u1 << 2, u2 << 2
    return y


def _q6_k(b):
    ql, qh, sc, d = b[0:128], b[128:192], b[192:208].view(np.int8), _f16(b[208:210])
    y = np.zeros(256, np.float32)
    for n in range(2):  # two halves of 128 values
        l_, h_, s_ = ql[64 * n:], qh[32 * n:], sc[8 * n:]
        for l in range(32):
            is_ = l // 16
            q1 = ((int(l_[l]) & 0xF) | (((int(h_[l]) >> 0) & 3) << 4)) - 32
            q2 = ((int(l_[l + 32]) & 0xF) | (((int(h_[l]) >> 2) & 3) << 4)) - 32
            q3 = ((int(l_[l]) >> 4) | (((int(h_[l]) >> 4) & 3) << 4)) - 32
            q4 = ((int(l_[l + 32]) >> 4) | (((int(h_[l]) >> 6) & 3) << 4)) - 32
            base = 128 * n
            y[base + l] = d * np.float32(s_[is_]) * np.float32(q1)
            y[base + l + 32] = d * np.float32(s_[is_ + 2]) * np.float32(q2)
            y[base + l + 64] = d * np.float32(s_[is_ + 4]) * np.float32(q3)
            y[base + l + 96] = d * np.float32(s_[is_ + 6]) * np.float32(q4)
    return list(y)


def _mxfp4(b):
    d = np.float32(2.0) ** (int(b[0]) - 128)  # GGML_E8M0_TO_FP32_HALF: half of 2^(e - 127)
    qs = b[1:17]
    return [d * np.float32(_MXFP4[int(q) & 0xF]) for q in qs] + [d * np.float32(_MXFP4[int(q) >> 4]) for q in qs]


def _iq4_nl(b):
    d, qs = _f16(b[0:2]), b[2:18]
    return [d * np.float32(_IQ4[int(q) & 0xF]) for q in qs] + [d * np.float32(_IQ4[int(q) >> 4]) for q in qs]


def _iq4_xs(b):
    d, scales_h, scales_l, qs = _f16(b[0:2]), int(b[2]) | (int(b[3]) << 8), b[4:8], b[8:136]
    y = []
    for ib in range(8):
        ls = ((int(scales_l[ib // 2]) >> (4 * (ib % 2))) & 0xF) | (((scales_h >> (2 * ib)) & 3) << 4)
        dl = d * np.float32(ls - 32)
        q = qs[16 * ib:16 * ib + 16]
        y += [dl * np.float32(_IQ4[int(v) & 0xF]) for v in q] + [dl * np.float32(_IQ4[int(v) >> 4]) for v in q]
    return y


_BLOCK_FNS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1,
              "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4,
              "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}


def dequantize(blocks: np.ndarray, kind: str) -> np.ndarray:
    """uint8 [n, type_size] -> float32 [n * block_size]."""
    fn = _BLOCK_FNS[kind]
    return np.asarray([v for b in blocks for v in fn(b)], dtype=np.float32)


def random_blocks(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    """n random but valid blocks: random quant bits, finite f16 scales of a sensible size."""
    block, size = BLOCKS[kind]
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)

    def put_f16(col: int, values: np.ndarray):
        raw[:, col:col + 2] = values.astype(np.float16).view(np.uint8).reshape(n, 2)

    if kind == "MXFP4":
        raw[:, 0] = rng.integers(110, 135, n)  # e8m0 exponents of weights' size
    elif kind == "Q6_K":
        put_f16(208, rng.uniform(0.001, 0.01, n))
    elif kind == "Q3_K":
        put_f16(108, rng.uniform(0.001, 0.01, n))
    elif kind == "Q2_K":
        put_f16(80, rng.uniform(0.001, 0.05, n))
        put_f16(82, rng.uniform(0.001, 0.02, n))
    else:
        put_f16(0, rng.uniform(-0.05, 0.05, n) if kind in ("Q8_0", "Q4_0", "Q5_0") else rng.uniform(0.001, 0.05, n))
        if kind in ("Q4_1", "Q5_1", "Q4_K", "Q5_K"):  # the min (K-quants: dmin)
            put_f16(2, rng.uniform(-0.5, 0.5, n) if kind.endswith("_1") else rng.uniform(0.001, 0.02, n))
    return raw
