#!/usr/bin/env python3
"""The loss-tolerant all-reduce against the reliable one under loss (issue #36): reads the JSON lines
of `scripts/bench-network --json` runs at several --loss values (one method per line, its `loss`,
`seconds` (median), `seconds_p99` and, for -lossy methods, `coverage`), prints a table by method
and loss, and plots p50 and p99 against the loss rate.

    scripts/bench-network --ranks 4 --rate 1gbit --rtt 30ms --loss 0.05 --size 1048576 \\
        --iterations 20 --methods none-ring-tcp,none-lossy100,bf16-lossy100 --json >> runs.jsonl
    bench/lossy_report.py runs.jsonl --plot docs/results/lossy_allreduce.png
"""

import argparse
import json
import sys


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="JSON lines of scripts/bench-network --json")
    p.add_argument("--plot", default=None, help="write the p50/p99 plot here (PNG)")
    args = p.parse_args()
    rows = []
    for path in args.files:
        for line in open(path):
            line = line.strip()
            if line.startswith("{"):
                rows.append(json.loads(line))
    if not rows:
        sys.exit("lossy_report.py: no results in " + ", ".join(args.files))
    methods = sorted({r["requested"] for r in rows}, key=lambda m: ("lossy" in m, m))
    losses = sorted({float(r["loss"]) for r in rows})
    by = {(r["requested"], float(r["loss"])): r for r in rows}
    print(f"{'method':<16} {'loss':>6} {'p50 s':>7} {'p99 s':>7} {'p99/p50(0)':>10} {'coverage':>8} {'vnmse':>9}")
    for m in methods:
        base = by.get((m, 0.0))
        for loss in losses:
            r = by.get((m, loss))
            if r is None:
                continue
            ratio = f"{r['seconds_p99'] / base['seconds']:.2f}" if base else "-"
            coverage = f"{r['coverage']:.3f}" if "lossy" in m else "-"
            print(f"{m:<16} {loss:>6g} {r['seconds']:>7.3f} {r['seconds_p99']:>7.3f} {ratio:>10} {coverage:>8} "
                  f"{r['vnmse']:>9.2e}")
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4))
        for m in methods:
            ran = [loss for loss in losses if (m, loss) in by]
            xs = [loss * 100 for loss in ran]
            line, = ax.plot(xs, [by[(m, loss)]["seconds"] for loss in ran], marker="o", label=f"{m} p50")
            ax.plot(xs, [by[(m, loss)]["seconds_p99"] for loss in ran], marker="x", linestyle="--",
                    color=line.get_color(), label=f"{m} p99")
        first = rows[0]
        ax.set_xlabel("packet loss per link direction (%)")
        ax.set_ylabel("all-reduce seconds")
        rate = first.get("link_rate_Bps") or 0
        ax.set_title(f"{first['world_size']} ranks, {4 * first['elements'] / 2**20:g} MiB fp32, "
                     f"{rate * 8 / 1e9:g} Gbit/s, RTT {first.get('rtt_ms', 0):g} ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
