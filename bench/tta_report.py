#!/usr/bin/env python3
"""Time to accuracy across codecs (issue #41): reads the JSON lines scripts/bench-tta collects (one
scripts/bench-train-network --json line per task, network, seed and method, with `eval`: step, test
loss, test accuracy and rank 0's training seconds so far) and writes, per task and network, the
wall time and wire bytes each method needs to reach a target test loss, its final test accuracy as
a share of uncompressed training's, and its steps/s, each as mean ± sample std over the seeds, plus
a plot of test loss against training time.

Target (per task, the same on every network, since a seed's loss curve does not depend on the
link): the worst, over the seeds, of the lowest test loss `none` reached within the first 75 % of
its steps, plus 1 % (--slack), so uncompressed training reaches it in every seed with a quarter of
the run to spare, a method slower per step or per unit of progress has room to reach it later,
and one within noise of `none` does not miss it by a rounding. --target TASK=LOSS sets one
instead. A run reaches the target at its first evaluation at or below it; the
time is rank 0's training seconds up to that step (evaluations left out), the bytes are the step
times the wire bytes per step node 0 sent to the other node.

    scripts/bench-tta --out /tmp/dq-tta            # runs, then calls this
    bench/tta_report.py /tmp/dq-tta/raw.jsonl --out /tmp/dq-tta
"""

import argparse
import json
import math
import os
import statistics
import sys

NONE = "none"


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def fmt(m, s, spec):
    return "—" if m is None else f"{m:{spec}} ± {s:{spec.lstrip('+')}}"


def time_to_target(run, target):
    """(step, seconds) of the run's first evaluation at or below target, or None."""
    for e in run["eval"]:
        if e["test_loss"] <= target:
            return e["step"], e["train_seconds"]
    return None


def targets_of(rows, overrides, slack):
    targets = {}
    for task in sorted({r["task"] for r in rows}):
        if task in overrides:
            targets[task] = overrides[task]
            continue
        best = []
        for r in rows:
            if r["task"] == task and r["method"] == NONE:
                early = [e["test_loss"] for e in r["eval"] if e["step"] <= 0.75 * r["steps"]]
                if early:
                    best.append(min(early))
        if best:
            targets[task] = max(best) * (1 + slack)
    return targets


def is_dynamiq(method):
    return method.split("-")[0] == "dynamiq"


def summarize(rows, task, network, target):
    runs = [r for r in rows if r["task"] == task and r["network"] == network]
    methods = list(dict.fromkeys(r["method"] for r in runs))  # first-seen order
    by = {(r["method"], int(r["seed"])): r for r in runs}
    seeds = sorted({int(r["seed"]) for r in runs})
    none_final = {s: by[(NONE, s)]["final_test_accuracy"] for s in seeds if (NONE, s) in by}
    none_tta = {s: time_to_target(by[(NONE, s)], target) for s in seeds if (NONE, s) in by}
    out = []
    for m in methods:
        mine = [(s, by[(m, s)]) for s in seeds if (m, s) in by]
        hits = [(s, r, time_to_target(r, target)) for s, r in mine]
        reached = [(s, r, h) for s, r, h in hits if h is not None]
        row = {
            "method": m, "seeds": len(mine), "reached": len(reached),
            "tta": mean_std([h[1] for _, _, h in reached]),
            "steps": mean_std([h[0] for _, _, h in reached]),
            "bytes": mean_std([h[0] * r["wire_bytes_per_step"] for _, r, h in reached]),
            "steps_per_second": mean_std([r["steps_per_second"] for _, r in mine]),
            "final_accuracy": mean_std([r["final_test_accuracy"] for _, r in mine]),
            "final_loss": mean_std([r["final_test_loss"] for _, r in mine]),
            "wire_bytes_per_step": mean_std([r["wire_bytes_per_step"] for _, r in mine]),
            # Paired by seed: the same initialisation and data order as `none`.
            "speedup": mean_std([none_tta[s][1] / h[1] for s, _, h in reached if none_tta.get(s)]),
            "accuracy_delta": mean_std([r["final_test_accuracy"] - none_final[s] for s, r in mine
                                        if s in none_final]),
        }
        if none_final:
            row["accuracy_ratio"] = row["final_accuracy"][0] / statistics.fmean(none_final.values())
        out.append(row)
    return out, seeds


def headline(summary):
    """DynamiQ's best time to target against the best other compressed method's (means over seeds,
    among methods that reached the target in every seed)."""
    full = [r for r in summary if r["reached"] == r["seeds"] and r["tta"][0] is not None]
    ours = [r for r in full if is_dynamiq(r["method"])]
    theirs = [r for r in full if not is_dynamiq(r["method"]) and r["method"] != NONE]
    if not ours or not theirs:
        return None
    a = min(ours, key=lambda r: r["tta"][0])
    b = min(theirs, key=lambda r: r["tta"][0])
    return a, b, 1 - a["tta"][0] / b["tta"][0]


def table(summary, seeds):
    lines = [
        "| method | reached | time to target s | steps to target | MB to target | speedup vs none (paired) "
        "| steps/s | final test accuracy | % of none | Δ acc paired | final test loss | wire MB/step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summary:
        mb = (None, None) if r["bytes"][0] is None else (r["bytes"][0] / 1e6, r["bytes"][1] / 1e6)
        pct = f"{100 * r['accuracy_ratio']:.2f}" if "accuracy_ratio" in r else "—"
        lines.append(
            f"| {r['method']} | {r['reached']}/{r['seeds']} | {fmt(*r['tta'], '.1f')} | {fmt(*r['steps'], '.0f')} "
            f"| {fmt(*mb, '.1f')} | {fmt(*r['speedup'], '.2f')} | {fmt(*r['steps_per_second'], '.2f')} "
            f"| {fmt(*r['final_accuracy'], '.4f')} | {pct} | {fmt(*r['accuracy_delta'], '+.4f')} "
            f"| {fmt(*r['final_loss'], '.4f')} | {r['wire_bytes_per_step'][0] / 1e6:.2f} |")
    return lines


def plot(rows, task, networks, target, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(networks), figsize=(6.5 * len(networks), 4.5), squeeze=False)
    for ax, network in zip(axes[0], networks):
        runs = [r for r in rows if r["task"] == task and r["network"] == network]
        for m in dict.fromkeys(r["method"] for r in runs):
            mine = [r for r in runs if r["method"] == m]
            n = min(len(r["eval"]) for r in mine)  # the same evaluation steps in every seed
            t = [statistics.fmean(r["eval"][i]["train_seconds"] for r in mine) for i in range(n)]
            loss = [statistics.fmean(r["eval"][i]["test_loss"] for r in mine) for i in range(n)]
            style = "-" if is_dynamiq(m) or m == NONE else "--"
            ax.plot(t, loss, style, label=m, linewidth=1.8 if m in (NONE, "dynamiq-5") else 1.0)
        ax.axhline(target, color="grey", linewidth=0.8, linestyle=":")
        ax.set_title(f"{task}, {network} links (mean of {len({r['seed'] for r in runs})} seeds)")
        ax.set_xlabel("training seconds (evaluations left out)")
        ax.set_ylabel("test loss")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("raw", help="JSON lines of scripts/bench-tta (OUT/raw.jsonl)")
    p.add_argument("--out", default=None, help="write report.md and tta_<task>.png here (default: print only)")
    p.add_argument("--target", action="append", default=[], metavar="TASK=LOSS", help="a task's target test loss")
    p.add_argument("--slack", type=float, default=0.01, help="relative margin over none's loss (default 0.01)")
    args = p.parse_args()
    rows = [json.loads(line) for line in open(args.raw) if line.strip()]
    if not rows:
        sys.exit(f"tta_report.py: no runs in {args.raw}")
    overrides = {}
    for t in args.target:
        task, _, loss = t.partition("=")
        try:
            overrides[task] = float(loss)
        except ValueError:
            sys.exit(f"tta_report.py: --target wants TASK=LOSS, got '{t}'")
    targets = targets_of(rows, overrides, args.slack)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    lines = []
    for task in sorted({r["task"] for r in rows}):
        if task not in targets:
            lines.append(f"## {task}: no `none` runs, so no target\n")
            continue
        r0 = next(r for r in rows if r["task"] == task)
        networks = list(dict.fromkeys(r["network"] for r in rows if r["task"] == task))
        lines.append(f"## {task}: {r0['parameters']:,} parameters, {r0['steps']} steps, global batch "
                     f"{r0['batch_size']}, {r0['nodes']} nodes x {r0['workers_per_node']} workers; "
                     f"target test loss {targets[task]:.4f}\n")
        for network in networks:
            summary, seeds = summarize(rows, task, network, targets[task])
            lines.append(f"### {network} (seeds {', '.join(map(str, seeds))})\n")
            lines += table(summary, seeds)
            h = headline(summary)
            if h:
                a, b, gain = h
                lines.append(f"\nFastest DynamiQ ({a['method']}, {a['tta'][0]:.1f} s) against the fastest other "
                             f"compressed method ({b['method']}, {b['tta'][0]:.1f} s): "
                             f"{100 * gain:+.1f} % less time to the target.")
            lines.append("")
        if args.out:
            path = os.path.join(args.out, f"tta_{task}.png")
            plot(rows, task, networks, targets[task], path)
            lines.append(f"![{task}: test loss against training time](tta_{task}.png)\n")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
