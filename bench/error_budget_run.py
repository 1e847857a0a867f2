#!/usr/bin/python3
"""Error-budget compression on a PyTorch task: examples/train.py through dynamiqd with a target vNMSE
instead of fixed bits, next to fixed-bit runs of the same task, seed and data (docs/results.md).

Runs (each through real daemons on loopback: --nodes x --workers-per-node workers):
  budget      dynamiqd --target_vnmse=T --budget_sample_rate=R (the controller on node 0 picks b̄)
  fixed-B     dynamiqd --bits=B for every B in --fixed
and writes to --out: one JSON file per run (examples/train.py --json --record-error), a Markdown
table (final test accuracy, mean bits, share of steps over target, wire bytes per step) and a PNG:
target, measured vNMSE and the chosen bits per step.

    bench/error_budget_run.py --out /tmp/eb --target 1e-3 --steps 300
"""

import argparse
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--out", required=True, help="output directory (created)")
    p.add_argument("--task", default="digits", help="examples/train.py --task (default digits)")
    p.add_argument("--target", type=float, default=1e-3, help="target vNMSE (default 1e-3)")
    p.add_argument("--sample-rate", type=float, default=0.5,
                   help="fraction of collectives whose error the daemon measures for the controller (default 0.5)")
    p.add_argument("--start-bits", type=float, default=5, help="b̄ the controller starts from (default 5)")
    p.add_argument("--fixed", default="4,5,6", help="comma-separated fixed budgets to compare (default 4,5,6)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--nodes", type=int, default=2, help="nodes, one dynamiqd each (default 2)")
    p.add_argument("--workers-per-node", type=int, default=2, help="workers per node (default 2)")
    p.add_argument("--train-arg", action="append", default=[], metavar="ARG",
                   help="extra examples/train.py argument (repeatable), e.g. --train-arg=--lr=0.1")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run (default 900)")
    p.add_argument("--python", default="/usr/bin/python3", help="Python with torch (default /usr/bin/python3)")
    p.add_argument("--replot", action="store_true", help="only redo the table and plot from --out's JSON files")
    return p.parse_args()


def run(a, name, bits, daemon_args):
    path = os.path.join(a.out, f"{name}.json")
    cmd = [a.python, os.path.join(REPO, "examples/train.py"), f"--task={a.task}", "--comm=dynamiq",
           "--codec=dynamiq", f"--bits={bits:g}", f"--nodes={a.nodes}", f"--workers-per-node={a.workers_per_node}",
           f"--steps={a.steps}", f"--seed={a.seed}", "--record-error", "--json", f"--timeout={a.timeout}"]
    cmd += [f"--dynamiqd-arg={d}" for d in daemon_args] + a.train_arg
    t = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout + 60)
    if r.returncode != 0:
        sys.exit(f"error_budget_run: {name} failed (rc {r.returncode}):\n{r.stderr[-4000:]}")
    result = json.loads(r.stdout)
    with open(path, "w") as f:
        json.dump(result, f)
    print(f"{name}: {time.time() - t:.0f} s, final test accuracy {result['final_test_accuracy']:.4f}",
          file=sys.stderr)
    return result


def summarize(name, r, target):
    v = [x for x in r["vnmse"] if x is not None]
    bits = [b for b in r.get("bits_per_step", []) if b]
    over = sum(1 for x in v if x > target)
    return (f"| {name} | {r['final_test_accuracy']:.4f} | {r['final_test_loss']:.4f} | "
            f"{sum(bits) / len(bits):.2f} | {sum(v) / len(v):.2e} | {max(v):.2e} | {100.0 * over / len(v):.1f}% | "
            f"{r['wire_bytes_per_step'] / 1e3:.1f} |")


def plot(a, budget, fixed, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    warm = budget.get("warmup_steps", 0)
    steps = list(range(warm, warm + len(budget["vnmse"])))
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for name, r in fixed.items():
        ax1.plot(steps, r["vnmse"], lw=0.8, alpha=0.5, label=f"fixed {name} bits")
    ax1.plot(steps, budget["vnmse"], lw=1.2, color="black", label="error budget: measured")
    ax1.axhline(a.target, color="red", ls="--", lw=1, label=f"target {a.target:g}")
    ax1.set_yscale("log")
    ax1.set_ylabel("vNMSE of the all-reduced gradient")
    ax1.legend(fontsize=8, ncol=2)
    ax1.set_title(f"{a.task}: error budget {a.target:g} ({a.nodes} nodes x {a.workers_per_node} workers, "
                  f"sample rate {a.sample_rate:g})", fontsize=10)
    ax2.step(steps, budget["bits_per_step"], where="post", color="black", lw=1.2, label="bits chosen")
    for name in fixed:
        ax2.axhline(float(name), lw=0.8, alpha=0.5, ls=":")
    ax2.set_ylabel("DynamiQ b̄")
    ax2.set_xlabel("training step")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main():
    a = parse_args()
    os.makedirs(a.out, exist_ok=True)
    def load_or_run(name, bits, daemon_args):
        if a.replot:
            with open(os.path.join(a.out, f"{name}.json")) as f:
                return json.load(f)
        return run(a, name, bits, daemon_args)

    budget = load_or_run("budget", a.start_bits,
                         [f"--target_vnmse={a.target:g}", f"--budget_sample_rate={a.sample_rate:g}"])
    if "bits_per_step" not in budget:
        sys.exit("error_budget_run: examples/train.py reported no per-step bits")
    fixed = {}
    for b in [x for x in a.fixed.split(",") if x]:
        fixed[b] = load_or_run(f"fixed-{b}", float(b), [])
    lines = [f"| run | final test accuracy | final test loss | mean bits | mean vNMSE | max vNMSE | "
             f"steps over {a.target:g} | wire kB/step |", "|---|---|---|---|---|---|---|---|",
             summarize(f"budget {a.target:g}", budget, a.target)]
    lines += [summarize(f"fixed {b}", r, a.target) for b, r in fixed.items()]
    table = "\n".join(lines) + "\n"
    with open(os.path.join(a.out, "table.md"), "w") as f:
        f.write(table)
    print(table)
    plot(a, budget, fixed, os.path.join(a.out, "error_budget.png"))


if __name__ == "__main__":
    main()
