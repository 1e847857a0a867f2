#!/usr/bin/python3
"""How much DynamiQ's allocation loses by weighting super-groups by the energy it can see.

The allocator (kernels/dynamiq_allocator.h) gives super-group j the widths that minimise
sum_j F_j err(w_j) with F_j = (sum over ranks of the rank's norm)^2, the only energy the bucket
statistics hold before the all-reduce. What a ring of n ranks actually pays is
W_j err(w_j) with W_j = sum_{k=1..n} ||S_k||^2, S_k the mean-centred partial sum after k hops (the
last one is the full sum, whose error every rank decodes): W_j / F_j is large where the ranks
agree (partial sums grow like k^2) and small where they do not (like k). This script allocates
one budget over a set's buckets (as one budget per step would) with three weights -- F, the
centred proxy max(0, F - 256 (sum of means)^2), and the true W (known only after the all-reduce,
e.g. from the previous step's result) -- and prints the model error sum_j W_j err(w_j) of each
relative to W's, with err(w) = 0.75 / L^2 (L = 2^(w-1) - 1: the scale of stochastic rounding's
error on max-scaled groups), widths 2..8, 256 w + 144 payload bits and 36 fixed bits per
super-group. A model, not a measurement: it says what a correlation-aware weight could gain.

    bench/allocation_weights_study.py /work/corpus20 lm4_w8_s120 cnn_w8_s300 --bits 4,5
"""

import argparse
import glob
import os

import numpy as np

WIDTHS = [2, 3, 4, 5, 6, 7, 8]


def err(w):
    return 0.75 / (2 ** (w - 1) - 1) ** 2


def allocate(weight, budget_bits):
    """Widths minimising sum weight_j err(w_j) within budget_bits of payload (Lagrangian bisection)."""
    table = np.stack([weight * err(w) for w in WIDTHS])
    costs = np.array([256.0 * w + 144.0 for w in WIDTHS])[:, None]
    lo, hi = -200.0, 200.0
    pick = lambda lg: np.array(WIDTHS)[(table + 2.0 ** lg * costs).argmin(0)]
    for _ in range(100):
        mid = 0.5 * (lo + hi)
        if (256.0 * pick(mid) + 144.0).sum() <= budget_bits:
            hi = mid
        else:
            lo = mid
    return pick(hi)


def weights(prefix, workers):
    x = np.stack([np.fromfile(f"{prefix}_aligned_r{r}.bin", dtype="<f4").astype(np.float64) for r in range(workers)])
    m = x.shape[1] // 256
    x = x[:, :m * 256].reshape(workers, m, 256)
    f = np.sqrt((x ** 2).sum(-1)).sum(0) ** 2
    fc = np.maximum(0.0, f - 256.0 * x.mean(-1).sum(0) ** 2)
    xc = x - (x.sum(0).mean(-1) / workers)[None, :, None]
    start = np.arange(m) * workers // m  # the ring chunk's first rank
    w = np.zeros(m)
    s = np.zeros((m, 256))
    for k in range(workers):
        s += xc[(start + k) % workers, np.arange(m)]
        w += (s ** 2).sum(-1)
    return f, fc, w


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("corpus")
    p.add_argument("sets", nargs="+", help="e.g. lm4_w8_s120 (all its buckets, aligned layout)")
    p.add_argument("--bits", default="4,5")
    p.add_argument("--workers", type=int, default=8)
    args = p.parse_args()
    print("| set | b | error with F / with W | centred proxy / W |\n|---|---|---|---|")
    for name in args.sets:
        prefixes = sorted({q.rsplit("_aligned", 1)[0] for q in glob.glob(os.path.join(args.corpus, f"{name}_b*_aligned_r0.bin"))})
        parts = [weights(q, args.workers) for q in prefixes]
        f, fc, w = (np.concatenate([pt[i] for pt in parts]) for i in range(3))
        active = f > 0
        for b in (float(v) for v in args.bits.split(",")):
            budget = b * 256 * len(f) - 36.0 * len(f)
            model = [(w[active] * err_w).sum() for err_w in
                     (np.vectorize(err)(allocate(v[active] + 1e-300, budget)) for v in (f, fc, w))]
            print(f"| {name} | {b:g} | {model[0] / model[2]:.3f} | {model[1] / model[2]:.3f} |")


if __name__ == "__main__":
    main()
