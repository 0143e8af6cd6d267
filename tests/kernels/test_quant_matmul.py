"""The quantized matmul (weld/kernels/cpu/quant_matmul.cc) against a numpy statement of its maths,
on every instruction-set path this CPU runs, and the QuantWeight type around it (packing, rows,
concatenation, GGUF blocks)."""

from __future__ import annotations

import gguf
import jax.numpy as jnp
import numpy as np
import pytest

from weld.kernels import cpu as cpu_kernels
from weld.models.common import layers, quant
from weld.utils.errors import InvalidInputError

ISAS = cpu_kernels.supported_isas()
# the kernel's distinct cases: 8, 6, 5 or 4 bits, an offset or mins, a scale per 32, per 16
# (q6_k, q3_k, q2_k) or per 128 inputs (int4_g128; q4_k / q5_k run as q4_1 / q5_1)
KERNEL_FORMATS = ["int8", "int4", "int4_g128", "q4_1", "q5_0", "q5_1", "q6_k", "q3_k", "q2_k", "mxfp4", "iq4_nl"]


def subs(fmt: str) -> int:
    return quant.subblocks(fmt)


def num_scales(fmt: str, k: int) -> int:
    """Scales (and mins) per output of a matrix with k inputs."""
    return quant.scales_shape(fmt, 1, k)[1] * subs(fmt)


def block_scales(v: np.ndarray, fmt: str, k: int) -> np.ndarray:
    """Scales [n, ng * sub] -> each block's [n, nb * sub] (a group's scale repeated for its blocks)."""
    return np.repeat(v, quant.group(fmt), axis=1)[:, :-(-k // quant.BLOCK) * subs(fmt)]


def values(codes: np.ndarray, fmt: str) -> np.ndarray:
    """The unsigned c of w = d (c - offset): a table format's codes index its int8 values (+ 128)."""
    table = quant.LUTS.get(fmt)
    return codes if table is None else (table.astype(np.int64) + 128)[codes]


@pytest.fixture
def kernels():
    """The test machines have a compiler: a kernel that failed to build is a failure, not a skip."""
    assert cpu_kernels.available() and ISAS, cpu_kernels._state.get("error")


needs_kernels = pytest.mark.usefixtures("kernels")


def random_blocks(rng, n: int, k: int, fmt: str, scale: float = 1.0):
    """Codes [n, k], scales and mins [n, nb * sub] of a random matrix in fmt (scales already f16-exact)."""
    bits, _, has_mins = quant.FORMATS[fmt]
    nb = num_scales(fmt, k)
    codes = rng.integers(0, 1 << bits, (n, k), dtype=np.uint8)
    d = (rng.uniform(0.2, 1.0, (n, nb)) * scale).astype(np.float16).astype(np.float32)
    mn = (rng.standard_normal((n, nb)) * scale).astype(np.float16).astype(np.float32) if has_mins else None
    return codes, d, mn


def dense(codes, d, mn, fmt) -> np.ndarray:
    """The float matrix the blocks state, in float64."""
    _, offset, _ = quant.FORMATS[fmt]
    n, k = codes.shape
    per = quant.SCALE_INPUTS.get(fmt, quant.BLOCK)
    per_input = lambda v: np.repeat(v.astype(np.float64), per, axis=1)[:, :k]  # noqa: E731
    codes = values(codes, fmt)
    if mn is None:
        return per_input(d) * (codes.astype(np.float64) - offset)
    return per_input(d) * codes + per_input(mn)


def reference(x: np.ndarray, codes, d, mn, fmt, digits: int | None = None) -> np.ndarray:
    """What the kernel computes: x's blocks of 32 quantized to int8 (sx = max|x| / 127, round half to
    even), exact integer dot products with the codes, then the f32 scales (float64 here). With two
    digits (the "int8" format) the f32 residual x - sx xq is quantized as well, with the scale
    max|x| / 32258, and multiplied too."""
    digits = quant.ACTIVATION_DIGITS.get(fmt, 1) if digits is None else digits
    _, offset, _ = quant.FORMATS[fmt]
    m, k = x.shape
    n = codes.shape[0]
    nb = -(-k // quant.BLOCK)
    xp = np.zeros((m, nb * quant.BLOCK), np.float32)
    xp[:, :k] = x
    xb = xp.reshape(m, nb, quant.BLOCK)
    amax = np.abs(xb).max(axis=-1)
    sub, per = subs(fmt), quant.BLOCK // subs(fmt)
    cp = np.zeros((n, nb * quant.BLOCK), np.int64)
    cp[:, :k] = values(codes, fmt)
    cb = cp.reshape(n, nb * sub, per)  # per scale: a block of 32, or each half of one
    d = block_scales(d, fmt, k)
    mv = block_scales(mn, fmt, k) if mn is not None else -offset * d
    total, value = 0.0, xb
    for levels in (127.0, 32258.0)[:digits]:
        inv = np.where(amax > 0, np.float32(levels) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        xq = np.clip(np.rint(value * inv[..., None]), -127, 127)
        sx = (amax / np.float32(levels)).astype(np.float32)
        # the residual as one fused multiply-add rounds it: exact in float64, then to f32
        value = (xb.astype(np.float64) - xq * sx[..., None].astype(np.float64)).astype(np.float32)
        xq = xq.astype(np.int64).reshape(m, nb * sub, per)
        dots = np.einsum("mbj,nbj->mnb", xq, cb)
        inner = d[None].astype(np.float64) * dots + mv[None].astype(np.float64) * xq.sum(-1)[:, None, :]
        total = total + (np.repeat(sx.astype(np.float64), sub, axis=1)[:, None, :] * inner).sum(-1)
    return total


def run(x, w: quant.QuantWeight, isa: str, digits: int | None = None) -> np.ndarray:
    digits = w.activation_digits if digits is None else digits
    return np.asarray(cpu_kernels.quant_matmul(jnp.asarray(x), w.codes, w.scales, w.mins, w.n, w.bits, w.offset, isa,
                                               digits, w.sub, w.lut, w.group))


def close(y, want, rtol=2e-6):
    scale = max(np.abs(want).max(), 1e-30)
    np.testing.assert_allclose(y, want, rtol=0, atol=rtol * scale * np.sqrt(want.shape[-1]) + 1e-37)


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
@pytest.mark.parametrize("m,n,k", [(1, 16, 32), (1, 40, 70), (3, 33, 96), (4, 17, 64), (5, 100, 300),
                                   (8, 48, 33), (13, 31, 128), (33, 20, 200), (65, 24, 1040)])
def test_matches_numpy_statement(isa, fmt, m, n, k):
    """k not a multiple of the block, n not a multiple of the panel, row counts across the kernel's
    row tiles: up to kStreamRows (64) rows the caller quantizes the activations while the panels'
    threads start, past it they are quantized in parallel first."""
    rng = np.random.default_rng(m * 1000 + n * 10 + k)
    codes, d, mn = random_blocks(rng, n, k, fmt)
    w = quant.from_codes(codes, d, mn, fmt)
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = reference(x, codes, d, mn, fmt)
    close(run(x, w, isa), want)
    # and the statement is the float matrix's product up to the activations' rounding: two digits
    # leave ~127x less of it than one
    exact = x.astype(np.float64) @ dense(codes, d, mn, fmt).T
    one = reference(x, codes, d, mn, fmt, digits=1)
    close(run(x, w, isa, digits=1), one)
    assert np.abs(one - exact).max() <= 0.02 * np.abs(exact).max()
    two = reference(x, codes, d, mn, fmt, digits=2)
    close(run(x, w, isa, digits=2), two)
    assert np.abs(two - exact).max() <= 0.02 / 50 * np.abs(exact).max()


@needs_kernels
@pytest.mark.parametrize("chunks", [1, 2, 3, 8, 64])
@pytest.mark.parametrize("m,n", [(1, 16), (1, 1000), (3, 530), (8, 4100), (64, 200)])
def test_every_panel_once_however_the_runs_are_claimed(chunks, m, n):
    """Few-row calls split the panels into one run per thread, claimed in `chunks` pieces, a
    thread done with its own taking the back of another's: a panel missed leaves its outputs
    unwritten, one taken twice by threads whose pieces overlap races on them. More chunks than a
    run has panels, and runs of one panel, included."""
    rng = np.random.default_rng(m * 7 + n)
    k = 96
    codes, d, mn = random_blocks(rng, n, k, "q4_1")
    w = quant.from_codes(codes, d, mn, "q4_1")
    x = rng.standard_normal((m, k)).astype(np.float32)
    want = reference(x, codes, d, mn, "q4_1", digits=1)
    for _ in range(3):  # the claims race differently each call
        y = np.asarray(cpu_kernels.quant_matmul(jnp.asarray(x), w.codes, w.scales, w.mins, w.n, w.bits, w.offset,
                                                digits=1, chunks=chunks))
        close(y, want)


# Calls of the quantized matmul from several threads at once, each checked against its own
# result computed alone first (a call's outputs are the same bits whichever threads did its
# panels); exits 3 if a call never finishes (a lost item hangs its caller) rather than hang.
RACE = """
import os, threading, time
import jax, jax.numpy as jnp, numpy as np
from weld.kernels import cpu
from weld.models.common import quant
rng = np.random.default_rng(11)
cases = []
for m, n, k in [(1, 1000, 96), (3, 530, 200), (2, 2000, 64), (8, 300, 128)]:
    w = quant.quantize(rng.standard_normal((n, k), np.float32), "int4")
    f = jax.jit(lambda x, w=w: cpu.quant_matmul(x, w.codes, w.scales, w.mins, w.n, w.bits, w.offset, digits=1))
    cases.append([f, jnp.asarray(rng.standard_normal((m, k), np.float32)), None])
bad = []
def alone():
    for case in cases:
        case[2] = np.asarray(case[0](case[1]))
def worker(f, x, want):
    for _ in range(40):
        if not np.array_equal(np.asarray(f(x)), want):
            bad.append(x.shape)
def within(threads, seconds):
    for t in threads:
        t.start()
    deadline = time.monotonic() + seconds
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() for t in threads):
        print("a call never finished", flush=True)
        os._exit(3)
within([threading.Thread(target=alone, daemon=True)], 120)  # compiles, then one call at a time
within([threading.Thread(target=worker, args=case, daemon=True) for case in cases], 60)
print("wrong outputs" if bad else "ok", bad, flush=True)
os._exit(1 if bad else 0)
"""


@needs_kernels
def test_calls_from_many_threads_at_once():
    """Calls made at once from several threads share XLA's pool: each caller must get every one
    of its panels done (by itself if no helper comes in time), with no output written by another
    call's items. Run in a subprocess: a lost item would hang the calling thread for good."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", RACE], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ok" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_extreme_codes_zero_blocks_and_scales(isa, fmt):
    """All-max and all-zero codes against all-+127 / all--127 activations (the AVX2 path's 16-bit
    pair sums at their limits), zero activation blocks, zero scales, f16's largest and subnormal
    scales, and activations near f32's range."""
    bits = quant.FORMATS[fmt][0]
    rng = np.random.default_rng(7)
    n, k = 32, 512
    codes = np.zeros((n, k), np.uint8)
    codes[:8] = (1 << bits) - 1
    codes[8:16] = rng.integers(0, 1 << bits, (8, k))
    codes[16:] = np.where(rng.random((16, k)) < 0.5, 0, (1 << bits) - 1)
    d = np.full((n, num_scales(fmt, k)), 1.0, np.float32)
    d[:, 1] = 0.0  # a zero scale
    d[:4, 2] = 65504.0  # f16's largest
    d[4:8, 2] = np.float32(np.float16(6e-8))  # a subnormal f16
    mn = np.full_like(d, -0.5) if quant.FORMATS[fmt][2] else None
    w = quant.from_codes(codes, d, mn, fmt)
    for x in (np.ones((3, k), np.float32), -np.ones((3, k), np.float32),
              np.concatenate([np.zeros((2, k // 2), np.float32), np.ones((2, k // 2), np.float32)], axis=1),
              np.sign(rng.standard_normal((5, k))).astype(np.float32) * 1e30,
              rng.standard_normal((4, k)).astype(np.float32) * 1e-30):
        close(run(x, w, isa), reference(x, codes, d, mn, fmt))


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_activation_codes_are_exact(isa):
    """Every path quantizes the activations to the same codes: half-way cases round to even, NaNs
    are left out of max|x| (and quantize to -127), whole blocks (the vector forms) and a block cut
    short by k (the scalar loop). The weights are the identity in q4_1 with d = 1 and mins 0, so
    the product is each code times its block's scale, one f32 rounding: y / sx gives the codes back
    exactly, and any code off by one shows. With two digits, y = sx q + sx2 q2 in f32."""
    k = 2 * quant.BLOCK + 13
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, k)).astype(np.float32) * np.float32(3)
    x[1, :quant.BLOCK] = np.arange(quant.BLOCK) - 15.5  # ties at inv = 127 / 15.5: not exact
    x[2, 0], x[2, 1:quant.BLOCK] = 127.0, np.arange(1, quant.BLOCK) * 0.5 - 8.0  # inv = 1: x.5 ties
    x[2, quant.BLOCK:2 * quant.BLOCK] = -np.arange(quant.BLOCK) * 4 - 0.5  # another scale's ties
    # NaNs, one in the lane of its block's max (13: lane 13 of the first 16, lane 5 of the second 8)
    x[3, 13], x[3, 29], x[3, 5], x[3, 62] = 50.0, np.nan, np.nan, np.nan
    x[4, 2 * quant.BLOCK:] = np.arange(13) * 0.5 + 0.5  # ties in the short block (max 6.5 -> 127)
    codes = np.eye(k, dtype=np.uint8)
    w = quant.from_codes(codes, np.ones((k, num_scales("q4_1", k)), np.float32),
                         np.zeros((k, num_scales("q4_1", k)), np.float32), "q4_1")
    nb = -(-k // quant.BLOCK)
    xb = np.zeros((5, nb * quant.BLOCK), np.float32)
    xb[:, :k] = x
    xb = xb.reshape(5, nb, quant.BLOCK)
    amax = np.nanmax(np.abs(xb), axis=-1)

    def digit(value, levels):
        inv = np.where(amax > 0, np.float32(levels) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
        with np.errstate(invalid="ignore"):
            q = np.nan_to_num(np.rint(value * inv[..., None]), nan=-127.0)
        return np.clip(q, -127, 127), (amax / np.float32(levels)).astype(np.float32)

    q, sx = digit(xb, 127.0)
    y1 = (q * sx[..., None]).astype(np.float32)  # an exact product of an int8 and an f32, rounded once
    assert np.sum(q[2, 0] % 2 == 0) > 8 and np.array_equal(q[2, 0, 1:5], [-8, -7, -6, -6])  # the ties are there
    np.testing.assert_array_equal(run(x, w, isa, digits=1), y1.reshape(5, -1)[:, :k])
    residual = (xb.astype(np.float64) - q * sx[..., None].astype(np.float64)).astype(np.float32)
    q2, sx2 = digit(residual, 32258.0)
    y2 = (y1 + (q2 * sx2[..., None]).astype(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(run(x, w, isa, digits=2), y2.reshape(5, -1)[:, :k])


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
def test_hand_checked_product(isa):
    """One block, one output: w = 0.5 (c - 128) with c = 129, x = 1: y = 32 * 0.5 = 16; with
    c = 130 on the odd inputs, y = 16 * 0.5 + 16 * 1.0 = 24."""
    codes = np.full((1, 32), 129, np.uint8)
    w = quant.from_codes(codes, np.full((1, 1), 0.5, np.float32), None, "int8")
    assert run(np.ones((1, 32), np.float32), w, isa)[0, 0] == pytest.approx(16.0, rel=1e-6)
    codes[0, 1::2] = 130
    w = quant.from_codes(codes, np.full((1, 1), 0.5, np.float32), None, "int8")
    assert run(np.ones((1, 32), np.float32), w, isa)[0, 0] == pytest.approx(24.0, rel=1e-6)


@needs_kernels
def test_isa_choice(monkeypatch):
    monkeypatch.setenv("WELD_CPU_ISA", "auto")
    assert cpu_kernels.quant_isa() == ISAS[-1]
    monkeypatch.setenv("WELD_CPU_ISA", "scalar")
    assert cpu_kernels.quant_isa() == "scalar"
    monkeypatch.setenv("WELD_CPU_ISA", "sse9")
    with pytest.raises(InvalidInputError, match="WELD_CPU_ISA must be auto or one of"):
        cpu_kernels.quant_isa()
    missing = [isa for isa in cpu_kernels.ISAS if isa not in ISAS]
    if missing:  # a path this CPU lacks is refused, not run
        monkeypatch.setenv("WELD_CPU_ISA", missing[0])
        with pytest.raises(InvalidInputError, match="this CPU runs only"):
            cpu_kernels.quant_isa()


@pytest.mark.parametrize("fmt", KERNEL_FORMATS)
def test_quant_weight_forms(fmt):
    """unpacked(), row lookups and concatenation state the same matrix as the blocks."""
    rng = np.random.default_rng(3)
    codes, d, mn = random_blocks(rng, 37, 70, fmt)
    w = quant.from_codes(codes, d, mn, fmt)
    want = dense(codes, d, mn, fmt)
    np.testing.assert_allclose(np.asarray(w.unpacked()), want, rtol=1e-6, atol=1e-6)
    ids = np.array([[0, 36, 15], [16, 17, 5]])
    np.testing.assert_allclose(np.asarray(w[jnp.asarray(ids)]), want[ids], rtol=1e-6, atol=1e-6)
    other = quant.from_codes(*random_blocks(rng, 32, 70, fmt), fmt)
    for parts in ([w, other], [other, other]):  # re-packed (37 rows) and panel-wise (32 + 32)
        cat = quant.concat_rows(parts)
        assert isinstance(cat, quant.QuantWeight) and cat.shape == (sum(p.n for p in parts), 70)
        np.testing.assert_array_equal(np.asarray(cat.unpacked()),
                                      np.concatenate([np.asarray(p.unpacked()) for p in parts]))
    assert quant.concat_rows([w, jnp.zeros((4, 70))]) is None  # mixed forms stay apart
    assert quant.concat_rows([w, quant.quantize(np.ones((16, 70)), "int8" if fmt != "int8" else "int4")]) is None


def test_linear_without_kernels_dequantizes(monkeypatch):
    """With the kernels off (or off the CPU) `linear` multiplies by the dequantized matrix in XLA."""
    monkeypatch.setenv("WELD_CPU_KERNELS", "0")
    rng = np.random.default_rng(5)
    w = quant.quantize(rng.standard_normal((24, 40)), "int4")
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    y = np.asarray(layers.linear(jnp.asarray(x), w))
    np.testing.assert_allclose(y, x @ np.asarray(w.unpacked()).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["int8", "int4", "int4_g128"])
def test_quantize_error_is_bounded(mode):
    """int8 (d = max|w| / 127, Q8_0's rule) is within half a step d plus the f16 rounding of d
    (2^-11 relative, over up to 127 steps). int4 (a scale and min per 32 inputs, int4_g128 per 128;
    the last group of k = 300 takes the 44 inputs left) leaves each group no more squared error
    than Q4_1's rule (mn = min w, d = (max w - mn) / 15, both f16, codes rounded against them),
    and less over the matrix: its fit searches steps and solves for (d, mn)."""
    rng = np.random.default_rng(11)
    k = 300
    w = rng.standard_normal((20, k)).astype(np.float32) * np.logspace(-2, 2, 20, dtype=np.float32)[:, None]
    w[3, 128:256] = 0.0  # an all-zero block (and group)
    w[5, 64:96] += 7.0 * np.abs(w[5]).max()  # a block far from zero: the range, not |w|, sets int4's step
    q = np.asarray(quant.quantize(w, mode).unpacked())
    assert np.all(q[3, 128:256] == 0.0)
    per = quant.SCALE_INPUTS.get(mode, quant.BLOCK)
    padded = np.pad(w, ((0, 0), (0, -k % per)), constant_values=np.nan).reshape(20, -1, per)
    if mode == "int8":
        step = np.nanmax(np.abs(padded), -1) / 127.0
        bound = np.repeat(step, per, axis=1)[:, :k] * (0.5 + 128 * 2.0 ** -11 + 1e-3)
        assert np.all(np.abs(q - w) <= bound + 1e-30)
    else:
        f16 = lambda v: v.astype(np.float16).astype(np.float32)  # noqa: E731
        mn = f16(np.nanmin(padded, -1))
        d = f16((np.nanmax(padded, -1) - mn) / 15.0)
        inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
        rule = d[..., None] * np.clip(np.rint((padded - mn[..., None]) * inv[..., None]), 0, 15) + mn[..., None]
        rule_err = np.nansum((padded - rule) ** 2, axis=-1)
        err = np.nansum((padded - np.pad(q, ((0, 0), (0, -k % per)), constant_values=np.nan).reshape(padded.shape)) ** 2,
                        axis=-1)
        assert np.all(err <= rule_err * (1 + 1e-5) + 1e-30)
        assert err.sum() < 0.95 * rule_err.sum()
    if mode == "int4_g128":  # one scale and min per 128 inputs: fewer bytes than per 32
        assert quant.quantize(w, mode).nbytes < quant.quantize(w, "int4").nbytes
    with pytest.raises(ValueError, match="quantization must be one of"):
        quant.quantize(w, "int3")


def gguf_raw(rng, type_name: str, n: int, k: int) -> np.ndarray:
    """Random blocks of a GGUF type as bytes [n, k / block * block bytes], with finite f16 scales
    (and mins / K-quants' dmin) in front."""
    _, per_block, size = quant.GGUF_KEPT[type_name]
    raw = rng.integers(0, 256, (n, k // per_block, size), dtype=np.uint8)
    halves = 2 if type_name in ("Q4_1", "Q5_1", "Q4_K", "Q5_K", "Q2_K") else 1
    at = slice(size - 2 * halves, size) if type_name in ("Q6_K", "Q3_K", "Q2_K") else slice(0, 2 * halves)  # d last
    raw[..., at] = (rng.standard_normal((n, k // per_block, halves)) * 0.1).astype(np.float16).view(np.uint8)
    if type_name == "MXFP4":  # an e8m0 exponent, not an f16 scale, leads the block
        raw[..., 0] = rng.integers(110, 135, (n, k // per_block))
    return raw.reshape(n, -1)


@pytest.mark.parametrize("type_name", sorted(quant.GGUF_KEPT))
def test_gguf_blocks_are_lossless(type_name):
    """Blocks of 32 repack exactly; super-blocks' (K-quants', IQ4_XS's) per-32 or per-16 scales
    d * sc and mins -dmin * m are exact products before packing and within f16's rounding (2^-11
    relative) after."""
    rng = np.random.default_rng(13)
    raw = gguf_raw(rng, type_name, 24, 512)
    want = gguf.quants.dequantize(raw, getattr(gguf.GGMLQuantizationType, type_name)).astype(np.float32)
    blocks = quant.gguf_blocks(raw, type_name, (24, 512))
    got = np.asarray(blocks.packed().unpacked())
    fmt, per_block, _ = quant.GGUF_KEPT[type_name]
    if per_block == 256:  # super-blocks: scale products per 32 (or 16), rounded to f16
        per_input = lambda v: np.repeat(v, 32 // subs(fmt), axis=1)  # noqa: E731
        _, offset, _ = quant.FORMATS[fmt]
        mins = blocks.mn if blocks.mn is not None else -offset * blocks.d
        c = values(blocks.codes, fmt)
        stated = per_input(blocks.d) * c + per_input(mins)
        np.testing.assert_allclose(stated, want, rtol=1e-6, atol=1e-7)
        bound = 2.0 ** -11 * (per_input(np.abs(blocks.d)) * c + per_input(np.abs(mins))) + 1e-7
        assert np.all(np.abs(got - want) <= bound) and np.any(got != want)
    else:
        np.testing.assert_array_equal(got, want)
    swapped = blocks.map_rows(lambda a: a[::-1])  # rows reorder alike
    np.testing.assert_array_equal(np.asarray(swapped.packed().unpacked()), got[::-1])
    with pytest.raises(ValueError, match=f"{type_name} tensor of shape"):
        quant.gguf_blocks(raw[:, :-1], type_name, (24, 512))  # truncated
    with pytest.raises(ValueError, match=f"{type_name} tensor of shape"):
        quant.gguf_blocks(raw[:, :-1], type_name, (24, 511))  # k not whole blocks


def test_k_quant_scales_beyond_f16_are_refused():
    raw = gguf_raw(np.random.default_rng(1), "Q4_K", 2, 256)
    raw[0, 0:2] = np.array([60000.0], np.float16).view(np.uint8)
    raw[0, 4] = 63  # sub-block 0's scale: 60000 * 63 overflows f16
    with pytest.raises(ValueError, match="beyond the f16 range"):
        quant.gguf_blocks(raw, "Q4_K", (2, 256))


def test_mxfp4_exponents_beyond_f16_are_refused():
    """MXFP4's scale 2^(e - 128) is kept exactly as an f16 for e in 104..143; outside, the
    tensor is refused with the reason (an exponent real weights do not reach)."""
    raw = gguf_raw(np.random.default_rng(2), "MXFP4", 2, 64)
    raw[1, 17] = 200
    with pytest.raises(ValueError, match="MXFP4 block exponents beyond the f16 range"):
        quant.gguf_blocks(raw, "MXFP4", (2, 64))
    raw[1, 17] = 143  # the largest that fits: 2^15
    w = quant.gguf_blocks(raw, "MXFP4", (2, 64)).packed()
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.MXFP4)
    np.testing.assert_array_equal(np.asarray(w.unpacked()), want)
