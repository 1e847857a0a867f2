#!/usr/bin/python3
"""A reference of THC (Li et al., "THC: Accelerating Distributed Deep Learning Using Tensor
Homomorphic Compression", NSDI'24) written from the paper's algorithm, in numpy, to check the
codec `thc` against on the real-gradient corpus (docs/compressors.md).

One all-reduce of n ranks' buckets x_1..x_n (d floats each), no error feedback:
  1. every rank zero-pads its bucket to P = 2^ceil(log2 d) and rotates it with the same
     randomized Hadamard transform y = H D x / sqrt(P) (D: random +-1 diagonal, shared seed);
  2. the global norm N = max_i |x_i| is agreed; z = y sqrt(P) / N has coordinates close to N(0, 1);
  3. z is clamped to [-T, T] (2 (1 - Phi(T)) = the table's overflow probability) and stochastically
     rounded twice, as the authors' code does: onto a fine grid of `--fine` points over [-T, T],
     then that point onto one of its two neighbouring entries of the lookup table R (integers
     0 = R[0] < ... < R[2^b - 1] = g), each step unbiased;
  4. the table values are summed as integers (the homomorphism: what a parameter server or a ring
     of integer sums carries), decoded y_hat = (S 2T/g - n T) N / sqrt(P), and rotated back:
     x_hat = D H y_hat / sqrt(P), of which the first d values are the result.
vNMSE = |x_hat - sum_i x_i|^2 / |sum_i x_i|^2, averaged over --trials (fresh D and rounding), and
per set energy-weighted over its buckets as bench/corpus_table.py does.

--block B rotates blocks of B elements instead of the whole bucket (the signs still span the
bucket): B = 256 is what the codec did before issue 41 (kernels/thc_math.h, one rotation per
256-element block, scaled by the bucket's global norm); the authors' published CUDA call passes
10 levels (blocks of 1024, `Hadamard.times = 10` in byteps/torch/compression.py).

Tables (--table):
  dynamiq  g = 42, 16 entries, T = 3.2972 (overflow 1/1024): the codec `thc`'s table
           (kernels/thc_math.h; the table of the DynamiQ paper's THC baseline)
  authors  g = 30, 16 entries, T = 2.1539 (overflow 1/32): the defaults of the authors' training
           scripts (--max-val 30 --quant-level 16 --overflow-freq 32) and their table for them

  bench/thc_reference.py /work/corpus20 --sets lm4_w8_s120,lm4_w8_s4,cnn_w8_s300
  bench/thc_reference.py /work/corpus20 --sets cnn_w8_s300 --block 256     # the pre-issue-41 codec
"""
import argparse
import glob
import math
import os
import sys

import numpy as np

TABLES = {
    "dynamiq": (42, 3.2972, [0, 6, 9, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 33, 36, 42]),
    "authors": (30, 2.1538746940614564, [0, 3, 5, 7, 9, 11, 13, 14, 16, 17, 19, 21, 23, 25, 27, 30]),
}


def hadamard(v, block):
    """Unnormalized Walsh-Hadamard transform of v (length a multiple of block) in blocks of `block`."""
    v = v.copy()
    h = 1
    while h < block:
        w = v.reshape(-1, 2, h)
        a = w[:, 0, :].copy()
        w[:, 0, :] += w[:, 1, :]
        w[:, 1, :] = a - w[:, 1, :]
        h *= 2
    return v


def quantize(z, table, fine, rng):
    """Table indices of z (already clamped to [-T, T]): fine grid, then the sender table."""
    g, t, r = table
    r = np.asarray(r, dtype=np.float64)
    delta = 2 * t / (fine - 1)
    pos = (z + t) / delta  # 0 .. fine-1
    lo = np.floor(pos)
    pos = lo + (rng.random(pos.shape) < (pos - lo))
    v = pos * delta * g / (2 * t)  # the fine point in table units, 0 .. g
    k = np.clip(np.searchsorted(r, v, side="right") - 1, 0, len(r) - 2)
    p = (v - r[k]) / (r[k + 1] - r[k])
    return k + (rng.random(v.shape) < p)


def allreduce(xs, table, fine, block, seed):
    """THC's estimate of sum(xs) (list of float64 arrays of one length)."""
    g, t, r = table
    d = xs[0].size
    p = 1 << max(0, math.ceil(math.log2(d)))
    b = p if block == 0 else min(block, p)
    rng = np.random.default_rng(seed)
    signs = rng.choice([-1.0, 1.0], size=p)
    norm = max(float(np.linalg.norm(x)) for x in xs)
    if norm == 0:
        return np.zeros(d)
    total = np.zeros(p)
    for x in xs:
        y = np.zeros(p)
        y[:d] = x
        y = hadamard(y * signs, b) / math.sqrt(b)
        z = np.clip(y * math.sqrt(p) / norm, -t, t)
        total += np.asarray(r, dtype=np.float64)[quantize(z, table, fine, rng)]
    y_hat = (total * (2 * t / g) - len(xs) * t) * norm / math.sqrt(p)
    return (hadamard(y_hat, b) / math.sqrt(b) * signs)[:d]


def bucket_files(corpus, name, layout):
    """{bucket: [rank files]} of a set such as lm4_w8_s120."""
    out = {}
    suffix = "_aligned" if layout == "aligned" else ""
    for path in sorted(glob.glob(os.path.join(corpus, f"{name}_b*{suffix}_r*.bin"))):
        base = os.path.basename(path)[len(name) + 2:]
        bucket, rest = base.split("_", 1)
        if (layout == "aligned") != rest.startswith("aligned"):
            continue
        out.setdefault(int(bucket), []).append(path)
    for files in out.values():
        files.sort(key=lambda f: int(f.rsplit("_r", 1)[1].split(".")[0]))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("corpus", help="corpus directory (bench/make_corpus.sh)")
    p.add_argument("--sets", default="lm4_w8_s120,lm4_w8_s4,cnn_w8_s300", help="comma-separated sets")
    p.add_argument("--layout", choices=["aligned", "ddp"], default="aligned",
                   help="aligned (what the DDP hook sends; corpus_table.py's default) or ddp")
    p.add_argument("--table", choices=sorted(TABLES), default="dynamiq")
    p.add_argument("--fine", type=int, default=1001, help="fine grid points (the authors' table_size; default 1001)")
    p.add_argument("--block", type=int, default=0, help="rotate blocks of this many elements (0: the whole bucket)")
    p.add_argument("--trials", type=int, default=3)
    args = p.parse_args()
    table = TABLES[args.table]
    print(f"# THC reference: table {args.table} (g={table[0]}, T={table[1]:.4f}), "
          f"rotation {'whole bucket' if args.block == 0 else f'blocks of {args.block}'}, {args.trials} trials")
    for name in args.sets.split(","):
        buckets = bucket_files(args.corpus, name, args.layout)
        if not buckets:
            sys.exit(f"no buckets of {name} in {args.corpus}")
        err_total = energy_total = 0.0
        for k in sorted(buckets):
            xs = [np.fromfile(f, dtype="<f4").astype(np.float64) for f in buckets[k]]
            exact = np.sum(xs, axis=0)
            energy = float(exact @ exact)
            err = np.mean([float(np.sum((allreduce(xs, table, args.fine, args.block, 1000 + s) - exact) ** 2))
                           for s in range(args.trials)])
            d = exact.size
            padded = 1 << max(0, math.ceil(math.log2(d)))
            print(f"{name} bucket {k}: {len(xs)} ranks, {d} elements (padded {padded}), vnmse {err / energy:.4g}")
            err_total += err
            energy_total += energy
        print(f"{name}: vnmse {err_total / energy_total:.4g}")


if __name__ == "__main__":
    main()
