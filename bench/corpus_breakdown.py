#!/usr/bin/python3
"""Where a codec's error lies in one corpus set (bench/make_corpus.sh): per tensor and per kind of
256-element super-group.

Runs dynamiq-bench codec (--dump_output) on each bucket of the set in the aligned layout (as
bench/corpus_table.py) for DynamiQ at --bits and MXFP8, and splits the squared error of the
all-reduced sum (rank 0, last trial) by tensor and by super-group class:

    bench/corpus_breakdown.py /work/corpus20 lm4 120 --bits 5

Columns: share of the set's energy (squared exact sum), DynamiQ's code width (rank 0's plan; mean
over the coordinates and energy-weighted; 0 = super-group zero on every rank), each codec's share of
its own error, and its relative error (error / energy) within the group of coordinates.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dump_gradients import aligned_layout  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SG = 256


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("corpus")
    p.add_argument("model")
    p.add_argument("step", type=int)
    p.add_argument("--bits", type=float, default=5.0, help="DynamiQ b̄ (default 5)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--bench", default=os.path.join(REPO, "build", "bin", "dynamiq-bench"))
    p.add_argument("--extra", default="", help="more dynamiq-bench flags")
    p.add_argument("--min-elements", type=int, default=4096)
    return p.parse_args()


def tensor_kind(name, shape):
    if len(shape) == 1:
        return "norm/bias vectors"
    if name.startswith(("tok", "bigram", "pos")):
        return f"embedding {name.split('.')[0]}"
    if name.startswith("head"):
        return "LM head"
    if "self_attn" in name:
        return "attention weights"
    if "linear" in name:
        return "FFN weights"
    return "conv weights" if len(shape) == 4 else "dense weights"


def main():
    args = parse_args()
    with open(os.path.join(args.corpus, f"{args.model}_w{args.workers}.json")) as f:
        manifest = json.load(f)
    dumps = [d for d in manifest["dumps"] if d["step"] == args.step and d["elements"] >= args.min_elements]
    if not dumps:
        raise SystemExit("no such set")
    codecs = [("DynamiQ", "dynamiq", args.bits), ("MXFP8", "mxfp8", 0)]
    per_kind, per_class = {}, {}
    total = {"energy": 0.0}
    for d in dumps:
        files = [os.path.join(args.corpus, os.path.basename(p)) for p in d["files"]]
        files = [f"{p.rsplit('_r', 1)[0]}_aligned_r{p.rsplit('_r', 1)[1]}" for p in files]
        ranks = np.stack([np.fromfile(p, dtype="<f4").astype(np.float64) for p in files])
        exact = ranks.sum(0)
        errs = {}
        with tempfile.TemporaryDirectory() as tmp:
            for label, codec, bits in codecs:
                cmd = [args.bench, "codec", f"--workers={args.workers}", f"--codec={codec}", "--trials=1",
                       "--min_time=0", "--json", f"--input={','.join(files)}", f"--dump_output={tmp}/{codec}"]
                if bits:
                    # The same wire bits per original coordinate as the unpadded bucket.
                    cmd.append(f"--bits={bits * d['elements'] / len(exact):.6f}")
                cmd += [a for a in args.extra.split() if a]
                subprocess.run(cmd, check=True, capture_output=True)
                errs[label] = (np.fromfile(f"{tmp}/{codec}.0.bin", dtype="<f4").astype(np.float64) - exact) ** 2
                if codec == "dynamiq":
                    sg_width = np.fromfile(f"{tmp}/{codec}.0.widths", dtype=np.uint8).astype(np.float64)
        width = np.repeat(sg_width, SG)[:len(exact)]  # each coordinate's code width
        sizes = [int(np.prod(p["shape"])) for p in d["parameters"]]
        offsets, _ = aligned_layout(sizes)
        energy = exact ** 2
        total["energy"] += energy.sum()
        for label in errs:
            total[label] = total.get(label, 0.0) + errs[label].sum()
        for p, n, off in zip(d["parameters"], sizes, offsets):
            k = tensor_kind(p["name"], p["shape"])
            acc = per_kind.setdefault(k, {"elements": 0, "energy": 0.0})
            acc["elements"] += n
            acc["energy"] += energy[off:off + n].sum()
            acc["width"] = acc.get("width", 0.0) + width[off:off + n].sum()
            acc["width_e"] = acc.get("width_e", 0.0) + (width[off:off + n] * energy[off:off + n]).sum()
            for label in errs:
                acc[label] = acc.get(label, 0.0) + errs[label][off:off + n].sum()
        # Super-group classes: by the share of coordinates that are exactly zero on every rank, and by
        # energy rank within the bucket.
        m = -(-len(exact) // SG)
        pad = m * SG - len(exact)
        sg_energy = np.pad(energy, (0, pad)).reshape(m, SG).sum(1)
        zeros = np.pad((ranks == 0).all(0), (0, pad), constant_values=True).reshape(m, SG).mean(1)
        order = np.argsort(-sg_energy)
        top = np.zeros(m, bool)
        top[order[:max(1, m // 10)]] = True
        for j in range(m):
            cls = ("top 10% energy" if top[j] else "other") + (
                ", all zero" if zeros[j] == 1 else ", >= 50% zeros" if zeros[j] >= 0.5 else
                ", some zeros" if zeros[j] > 0 else ", dense")
            acc = per_class.setdefault(cls, {"elements": 0, "energy": 0.0})
            acc["elements"] += SG
            acc["energy"] += sg_energy[j]
            acc["width"] = acc.get("width", 0.0) + sg_width[j] * SG
            acc["width_e"] = acc.get("width_e", 0.0) + sg_width[j] * sg_energy[j]
            for label in errs:
                acc[label] = acc.get(label, 0.0) + np.pad(errs[label], (0, pad))[j * SG:(j + 1) * SG].sum()
    labels = [c[0] for c in codecs]
    print(f"{args.model} step {args.step}, {args.workers} ranks, ring; DynamiQ b̄ {args.bits:g}: vNMSE "
          + ", ".join(f"{lb} {total[lb] / total['energy']:.2e}" for lb in labels) + "\n")
    for title, table in (("tensors", per_kind), ("super-groups", per_class)):
        print(f"| {title} | elements | energy share | DynamiQ width (mean, energy-weighted) | " +
              " | ".join(f"{lb} error share | {lb} rel. error" for lb in labels) + " |")
        print("|---" * (4 + 2 * len(labels)) + "|")
        for k, a in sorted(table.items(), key=lambda kv: -kv[1]["energy"]):
            cells = []
            for lb in labels:
                rel = a[lb] / a["energy"] if a["energy"] > 0 else float("inf") if a[lb] > 0 else 0.0
                cells.append(f"{a[lb] / total[lb]:.3f} | {rel:.2e}")
            wmean = a["width"] / a["elements"]
            wenergy = a["width_e"] / a["energy"] if a["energy"] > 0 else 0.0
            print(f"| {k} | {a['elements']:,} | {a['energy'] / total['energy']:.3f} | {wmean:.2f}, {wenergy:.2f} | " +
                  " | ".join(cells) + " |")
        print()


if __name__ == "__main__":
    main()
