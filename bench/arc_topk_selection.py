#!/usr/bin/python3
"""How good ARC-Top-K's row selection is: the sketch against the exact Top-K rows of the sum.

For every 8-rank set of the real-gradient corpus (bench/make_corpus.sh) and density, the fraction of
the summed gradient's energy left out by keeping the top ceil(density x rows) rows of 256 by
  oracle          the exact squared norm of each row of the sum (what an all-gather Top-K could pick)
  sketch          |sum_i x_i V|^2 with a 256 x 4 +-1 V shared by the ranks (what arc_topk does)
  per-rank norms  sum_i |x_i|^2 per row (an exact, equally cheap statistic that cannot see values
                  cancelling between ranks)
The left-out energy is the codec's vNMSE for one step without error feedback (fp32 values are exact).

    bench/arc_topk_selection.py [--corpus /work/corpus20] [--sets lm4_w8_s120_b0,...] [--densities 0.05,0.1,0.25]
"""

import argparse
import glob
import os

import numpy as np


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", default="/work/corpus20")
    p.add_argument("--sets", default="lm4_w8_s120_b0,lm4_w8_s4_b0,cnn_w8_s300_b0")
    p.add_argument("--densities", default="0.05,0.1,0.25")
    p.add_argument("--seed", type=int, default=0, help="seed of V")
    args = p.parse_args(argv)
    v = np.random.default_rng(args.seed).choice([-1.0, 1.0], size=(256, 4))
    print("| set | density | oracle | sketch | per-rank norms |")
    print("|---|---:|---:|---:|---:|")
    for name in args.sets.split(","):
        files = sorted(glob.glob(os.path.join(args.corpus, f"{name}_r?.bin")))
        if not files:
            raise SystemExit(f"no files {name}_r?.bin in {args.corpus}")
        xs = [np.fromfile(f, dtype=np.float32).astype(np.float64) for f in files]
        rows = (len(xs[0]) + 255) // 256
        x = np.stack([np.pad(a, (0, rows * 256 - len(a))).reshape(rows, 256) for a in xs])
        true = (x.sum(0) ** 2).sum(1)
        scores = (true, (((x @ v).sum(0)) ** 2).sum(1), (x ** 2).sum((0, 2)))
        for density in (float(s) for s in args.densities.split(",")):
            k = int(np.ceil(density * rows))
            left = [1 - true[np.argsort(-s, kind="stable")[:k]].sum() / true.sum() for s in scores]
            print(f"| {name} | {density:g} | {left[0]:.3g} | {left[1]:.3g} | {left[2]:.3g} |")


if __name__ == "__main__":
    main()
