#!/usr/bin/python3
"""One quantization of real gradients, in expectation, without the all-reduce: how far DynamiQ's
group quantizer (16-element groups scaled to their maximum, 2L + 1 uniform levels, stochastic
rounding) is from MXFP8 (E4M3, round to nearest, power-of-two scale per 32) at a fixed code width,
what a Gaussian rate-distortion bound with per-group variances allows at the same bits per
coordinate, and what subtractive dithering (a shared pseudo-random offset added before rounding to nearest and
removed after decoding, also unbiased) would change. Exact expectations, no sampling.

    bench/quantizer_study.py /work/corpus20/lm4_w8_s120_b1_aligned_r0.bin [more files]

Prints, per file, the relative squared error (error / energy) of each quantizer.
"""

import sys

import numpy as np


def groups(x, size):
    pad = -len(x) % size
    return np.pad(x, (0, pad)).reshape(-1, size)


def sr_uniform(x, bits):
    """Expected squared error of stochastic rounding onto max-scaled uniform levels."""
    g = groups(x, 16)
    L = 2 ** (bits - 1) - 1
    delta = np.abs(g).max(1, keepdims=True) / L
    y = np.divide(np.abs(g), delta, out=np.zeros_like(g), where=delta > 0)
    p = y - np.floor(y)
    return float((p * (1 - p) * delta ** 2).sum())


def dither_uniform(x, bits):
    """Subtractive dither: uniform error of Δ²/12 per element, Δ = max / (L - 1/2) so x + d fits."""
    g = groups(x, 16)
    L = 2 ** (bits - 1) - 1
    delta = np.abs(g).max(1, keepdims=True) / (L - 0.5)
    n = np.full_like(delta, 16.0)
    n[-1] = 16 - (-len(x) % 16)
    return float((n * delta ** 2 / 12).sum())


def mxfp8(x):
    """Round to nearest on E4M3 after the OCP MX power-of-two scale (max normal 448, 3 mantissa bits)."""
    g = groups(x, 32)
    m = np.abs(g).max(1, keepdims=True)
    e = np.floor(np.log2(np.where(m > 0, m, 1.0))) - 8  # emax of E4M3 is 8
    v = g / 2.0 ** e
    a = np.abs(v)
    k = np.floor(np.log2(np.where(a > 0, a, 1.0)))
    ulp = 2.0 ** (np.maximum(k, -6) - 3)  # subnormals below 2^-6
    q = np.minimum(np.round(a / ulp) * ulp, 448.0) * np.sign(v)
    return float((((q - v) * 2.0 ** e) ** 2).sum())


def water_filling(x, bits, size=16):
    """Rate-distortion bound of a Gaussian source with each group's own variance (reverse water-filling
    at `bits` per coordinate, side information free): no codec, biased or not, does better on such
    data; real groups are not Gaussian, so this is an estimate, not a proof."""
    var = (groups(x, size) ** 2).mean(1)
    var = var[var > 0]
    lo, hi = np.log2(var.min()) - 60, np.log2(var.max())
    for _ in range(100):
        t = 0.5 * (lo + hi)
        rate = 0.5 * np.maximum(0, np.log2(var) - t).sum() / len(var)
        lo, hi = (t, hi) if rate > bits else (lo, t)
    return float(np.minimum(var, 2.0 ** hi).sum() * size)


def main():
    for path in sys.argv[1:]:
        x = np.fromfile(path, dtype="<f4").astype(np.float64)
        energy = float(x @ x)
        mx = mxfp8(x) / energy
        cells = [f"MXFP8 {mx:.2e}"]
        for b in (3, 4, 5, 6, 7, 8):
            sr, di = sr_uniform(x, b) / energy, dither_uniform(x, b) / energy
            cells.append(f"{b}b SR {sr:.2e} dither {di:.2e} (x{sr / di:.2f}; SR/MXFP8 {sr / mx:.1f}); "
                         f"Gaussian bound at {b} b/coord {water_filling(x, b) / energy:.2e}")
        print(path + "\n  " + "\n  ".join(cells))


if __name__ == "__main__":
    main()
