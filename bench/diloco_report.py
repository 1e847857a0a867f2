#!/usr/bin/python3
"""Tables and plots of scripts/bench-diloco-network results (JSON lines of examples/diloco.py):

    bench/diloco_report.py results.jsonl --plots docs/results

Prints a markdown table (per outer all-reduce codec, mean +- sample std over seeds: final
validation loss and accuracy, their difference from fp32 exact (codec none) with the same seed,
wire bytes node 0 sent per outer step and the time they take at the link rate, wall time of the
training loop) and writes diloco_curves.png (validation loss per outer step) and
diloco_bytes.png (final validation loss against wire bytes per outer step)."""

import argparse
import collections
import json
import os
import statistics

ORDER = ["none", "bf16", "int8", "dynamiq-5", "dynamiq-4", "dynamiq-3"]
LABEL = {"none": "fp32 exact", "bf16": "bf16", "int8": "int8 (INTELLECT-1 style)", "dynamiq-5": "DynamiQ 5 bits",
         "dynamiq-4": "DynamiQ 4 bits", "dynamiq-3": "DynamiQ 3 bits"}


def stats(values):
    mean = statistics.fmean(values)
    return mean, (statistics.stdev(values) if len(values) > 1 else 0.0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results")
    p.add_argument("--plots", default=None, help="directory for the PNGs")
    args = p.parse_args()
    rows = [json.loads(line) for line in open(args.results) if line.strip()]
    by = collections.defaultdict(list)
    for r in rows:
        by[r["method"]].append(r)
    methods = [m for m in ORDER if m in by] + sorted(m for m in by if m not in ORDER)
    exact = {r["seed"]: r for r in by.get("none", [])}
    r0 = rows[0]
    print(f"{r0['world_size']} nodes x 1 worker, links {r0['rate']}, {r0['outer_steps']} outer steps x "
          f"{r0['inner_steps']} inner AdamW steps, {r0['parameters']} parameters, seeds "
          f"{sorted({r['seed'] for r in rows})}\n")
    print("| outer all-reduce | final val loss | Δ loss vs exact (paired) | final val accuracy | Δ accuracy vs exact "
          "(paired) | wire KB / outer step | vs int8 | link ms / outer step | wall s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    int8_bytes = stats([r["wire_bytes_per_outer_step"] for r in by["int8"]])[0] if "int8" in by else None
    for m in methods:
        rs = by[m]
        loss, loss_sd = stats([r["final_val_loss"] for r in rs])
        acc, acc_sd = stats([r["final_val_accuracy"] for r in rs])
        paired = [r for r in rs if r["seed"] in exact]
        if paired and m != "none":
            dl, dl_sd = stats([r["final_val_loss"] - exact[r["seed"]]["final_val_loss"] for r in paired])
            da, da_sd = stats([r["final_val_accuracy"] - exact[r["seed"]]["final_val_accuracy"] for r in paired])
            dls, das = f"{dl:+.4f} ± {dl_sd:.4f}", f"{da:+.4f} ± {da_sd:.4f}"
        else:
            dls = das = "-"
        wire = stats([r["wire_bytes_per_outer_step"] for r in rs])[0]
        secs, secs_sd = stats([r["seconds"] for r in rs])
        link = wire / rs[0]["link_rate_Bps"]  # the link's own time for what node 0 sends
        vs = f"{wire / int8_bytes:.2f}x" if int8_bytes else "-"
        print(f"| {LABEL.get(m, m)} | {loss:.4f} ± {loss_sd:.4f} | {dls} | {acc:.4f} ± {acc_sd:.4f} | {das} | "
              f"{wire / 1e3:.1f} | {vs} | {link * 1e3:.0f} | {secs:.1f} ± {secs_sd:.1f} |")
    if not args.plots:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    os.makedirs(args.plots, exist_ok=True)
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(9, 3.4))
    exact = {(r["seed"], e["outer_step"]): e["val_loss"] for r in by.get("none", []) for e in r["eval"]}
    for m in methods:
        curves, diffs = collections.defaultdict(list), collections.defaultdict(list)
        for r in by[m]:
            for e in r["eval"]:
                curves[e["outer_step"]].append(e["val_loss"])
                if (r["seed"], e["outer_step"]) in exact:
                    diffs[e["outer_step"]].append(e["val_loss"] - exact[(r["seed"], e["outer_step"])])
        xs = sorted(curves)
        ax.plot(xs, [statistics.fmean(curves[x]) for x in xs], marker="o", markersize=3, label=LABEL.get(m, m))
        xs = sorted(diffs)
        dx.plot(xs, [statistics.fmean(diffs[x]) for x in xs], marker="o", markersize=3, label=LABEL.get(m, m))
    ax.set_xlabel("outer step")
    ax.set_ylabel("validation loss (mean over seeds)")
    ax.set_title("DiLoCo on the byte LM", fontsize=9)
    ax.legend(fontsize=7)
    dx.axhline(0, color="gray", linewidth=0.8)
    dx.set_xlabel("outer step")
    dx.set_ylabel("minus fp32 exact, same seed (mean)")
    dx.set_title("validation loss relative to exact", fontsize=9)
    fig.tight_layout()
    fig.savefig(os.path.join(args.plots, "diloco_curves.png"), dpi=80)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m in methods:
        rs = by[m]
        wire = stats([r["wire_bytes_per_outer_step"] for r in rs])[0] / 1e3
        loss, sd = stats([r["final_val_loss"] for r in rs])
        ax.errorbar([wire], [loss], yerr=[sd], fmt="o", capsize=3, label=LABEL.get(m, m))
    ax.set_xscale("log")
    ax.set_xlabel("wire KB node 0 sent per outer all-reduce (log)")
    ax.set_ylabel("final validation loss")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(args.plots, "diloco_bytes.png"), dpi=80)


if __name__ == "__main__":
    main()
