#!/usr/bin/python3
"""dynamiq-bench codec over a gradient corpus (bench/make_corpus.sh): one table per set.

By default the buckets are measured in the layout dynamiqd receives from dynamiq.torch's DDP hook
(super-group aligned: bench/dump_gradients.py --align, run by make_corpus.sh), with DynamiQ's b̄
scaled so that its wire bits per original coordinate are the b of the table (the padding travels
too); --layout ddp measures DDP's own bucket order instead.

A set is one model at one dumped step (e.g. lm4 step 120): all its DDP buckets of at least
--min-elements elements (smaller ones travel uncompressed in dynamiqd). Each bucket is all-reduced
by the simulated --topology over its --workers rank files; a set's vNMSE is the energy-weighted mean
of its buckets' (sum of squared errors over the sum of squared exact results, as if the set were one
vector), its wire bits the element-weighted mean.

    bench/make_corpus.sh /work/corpus20
    bench/corpus_table.py /work/corpus20 > tables.md
    bench/corpus_table.py /work/corpus20 --step-budget --steps 5,120,300   # one budget per step

Prints markdown: per set, vNMSE of DynamiQ and uniform at --bits (DynamiQ's b̄ includes all its
metadata; uniform b costs b + 0.5 wire bits), bf16, the MX formats and THC; then a summary with
the issue-20 targets (DynamiQ 5 b <= 0.5x MXFP8 on transformer sets and <= 0.3x on CNN sets,
DynamiQ 4 b <= MXFP8 everywhere). --json FILE also writes every bucket's raw rows.
"""

import argparse
import concurrent.futures
import glob
import json
import os
import subprocess

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXED = ["bf16", "mxfp8", "mxfp6", "mxfp4", "thc"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("corpus", help="directory of bench/dump_gradients.py manifests (<model>_w<workers>.json)")
    p.add_argument("--bench", default=os.path.join(REPO, "build", "bin", "dynamiq-bench"))
    p.add_argument("--workers", type=int, default=8, help="manifests of this many ranks (default 8)")
    p.add_argument("--topology", default="ring")
    p.add_argument("--bits", default="3,4,5,6,7,8", help="DynamiQ b̄ and uniform bits (default 3..8)")
    p.add_argument("--codecs", default="dynamiq,uniform," + ",".join(FIXED),
                   help="dynamiq-bench codec names (default all but none)")
    p.add_argument("--trials", type=int, default=2, help="all-reduces averaged per bucket (default 2)")
    p.add_argument("--layout", choices=["aligned", "ddp"], default="aligned",
                   help="aligned (what the DDP hook sends; default) or ddp (DDP's bucket as is)")
    p.add_argument("--joint", action="store_true",
                   help="all-reduce each set's buckets as one vector (concatenated per rank, each bucket "
                        "starting on a 256-element super-group): what one bit budget per step, allocated "
                        "across the step's buckets, would give (dynamiqd allocates per bucket)")
    p.add_argument("--step-budget", action="store_true",
                   help="one DynamiQ budget per step: each bucket's b̄ is its share of the step's (dynamiq-bench "
                        "step-budget) planned from the previous dumped step's buckets, as dynamiqd would plan step "
                        "s from step s-1's statistics; sets without an earlier dump of the same buckets are left out")
    p.add_argument("--plan-from", choices=["previous", "same"], default="previous",
                   help="--step-budget: plan from the previous dumped step (what dynamiqd can do; default) or "
                        "from the measured step itself (the best a per-step split can do)")
    p.add_argument("--plan-energy", choices=["statistics", "result"], default="statistics",
                   help="--step-budget: weigh super-groups by the statistics' energy (default) or by the "
                        "all-reduced result's (dynamiq-bench step-budget --step_energy)")
    p.add_argument("--steps", default="", help="comma-separated steps to report (default all)")
    p.add_argument("--min-elements", type=int, default=4096, help="skip smaller buckets (default 4096)")
    p.add_argument("--models", default="", help="comma-separated models to include (default all)")
    p.add_argument("--jobs", type=int, default=1, help="dynamiq-bench processes at once (default 1)")
    p.add_argument("--extra", default="", help="more dynamiq-bench flags, e.g. --levels=mee")
    p.add_argument("--json", help="write every bucket's rows to this file")
    return p.parse_args()


def load_sets(args):
    """{(model, step): [dump, ...]} from the corpus manifests."""
    sets = {}
    wanted = {m for m in args.models.split(",") if m}
    for path in sorted(glob.glob(os.path.join(args.corpus, f"*_w{args.workers}.json"))):
        with open(path) as f:
            manifest = json.load(f)
        if wanted and manifest["model"] not in wanted:
            continue
        for d in manifest["dumps"]:
            if d["elements"] >= args.min_elements:
                # Manifests name absolute paths; follow the corpus if it was moved.
                d["files"] = [os.path.join(args.corpus, os.path.basename(p)) for p in d["files"]]
                sets.setdefault((manifest["model"], d["step"]), []).append(d)
    if not sets:
        raise SystemExit(f"no {args.workers}-rank dumps of >= {args.min_elements} elements under {args.corpus}")
    return sets


def bench(args, files, codecs, bits):
    cmd = [args.bench, "codec", f"--workers={args.workers}", f"--topology={args.topology}", f"--codec={codecs}",
           f"--bits={bits}", f"--trials={args.trials}", "--min_time=0", "--json", f"--input={','.join(files)}"]
    out = subprocess.run(cmd + [a for a in args.extra.split() if a], check=True, capture_output=True, text=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def sent_files(args, dump):
    """The dump's files in the measured layout."""
    files = dump["files"]
    if args.layout == "aligned" and not dump.get("raw"):
        files = [f"{p.rsplit('_r', 1)[0]}_aligned_r{p.rsplit('_r', 1)[1]}" for p in files]
        if not all(os.path.exists(p) for p in files):
            raise SystemExit(f"{files[0]} missing: run bench/dump_gradients.py --align on the manifest first")
    return files


def step_budgets(args, dumps):
    """{b: [b̄ of each bucket]}: the step budget b (per original coordinate) split over `dumps`' buckets."""
    files = [sent_files(args, d) for d in dumps]
    scale = sum(d["elements"] for d in dumps) / sum(os.path.getsize(f[0]) // 4 for f in files)
    bits = [float(b) for b in args.bits.split(",") if b]
    cmd = [args.bench, "step-budget", f"--workers={args.workers}", "--bits=" + ",".join(f"{b * scale:.6f}" for b in bits),
           "--input=" + ";".join(",".join(f) for f in files), f"--step_energy={args.plan_energy}"]
    out = subprocess.run(cmd + [a for a in args.extra.split() if a], check=True, capture_output=True, text=True)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {b: [r["bits"] for r in rows[i * len(dumps):(i + 1) * len(dumps)]] for i, b in enumerate(bits)}


def run_bucket(args, dump, budgets=None):
    """dynamiq-bench codec over one bucket. budgets: {b: this bucket's b̄} (one budget per step) or None."""
    files = sent_files(args, dump)
    total = os.path.getsize(files[0]) // 4
    scale = dump["elements"] / total  # DynamiQ's b̄ per sent coordinate at b bits per original one
    codecs = args.codecs.split(",")
    rows = []
    if "dynamiq" in codecs:
        if budgets is not None:  # already per sent coordinate, within [3, 8]
            bits = [float(b) for b in args.bits.split(",") if b]
            dq = bench(args, files, "dynamiq", ",".join(f"{budgets[b]:.6f}" for b in bits))
        else:
            # dynamiq-bench takes b̄ in [3, 8]; padding may push 3 (8) just outside: that cell stays empty.
            bits = [float(b) for b in args.bits.split(",") if b and 3 <= float(b) * scale <= 8]
            dq = bench(args, files, "dynamiq", ",".join(f"{b * scale:.6f}" for b in bits))
        for b, r in zip(bits, dq):
            r["bits_target"], r["wire_bits_per_coord"] = b, r["wire_bits_per_coord"] / scale
            rows.append(r)
    others = [c for c in codecs if c != "dynamiq"]
    if others:
        for r in bench(args, files, ",".join(others), args.bits):
            r["wire_bits_per_coord"] /= scale
            rows.append(r)
    exact = sum(np.fromfile(p, dtype="<f4").astype(np.float64) for p in files)
    return {"files": files, "elements": dump["elements"], "sent": total, "energy": float(exact @ exact),
            "rows": rows}


def key(row):
    return (row["codec"], row["bits_target"] if row["codec"] in ("dynamiq", "uniform") else None)


def combine(buckets):
    """{(codec, bits): (vnmse, wire_bits)} of a set, energy/element weighted over its buckets."""
    total_e = sum(b["energy"] for b in buckets)
    total_n = sum(b["elements"] for b in buckets)
    acc = {}
    for b in buckets:
        for r in b["rows"]:
            if "skipped" in r:
                continue
            e, w = acc.get(key(r), (0.0, 0.0))
            acc[key(r)] = (e + r["vnmse"] * b["energy"], w + r["wire_bits_per_coord"] * b["elements"])
    return {k: (e / total_e, w / total_n) for k, (e, w) in acc.items()}


def is_transformer(model):
    return model.startswith("lm")


def join_buckets(args, sets):
    """One dump per set: the aligned buckets concatenated per rank (in a joint/ subdirectory)."""
    out = os.path.join(args.corpus, "joint")
    os.makedirs(out, exist_ok=True)
    joined = {}
    for (model, step), dumps in sets.items():
        files = []
        for r in range(args.workers):
            path = os.path.join(out, f"{model}_w{args.workers}_s{step}_b0_r{r}.bin")
            parts = []
            for d in dumps:
                src = d["files"][r]
                if args.layout == "aligned":
                    src = f"{src.rsplit('_r', 1)[0]}_aligned_r{src.rsplit('_r', 1)[1]}"
                x = np.fromfile(src, dtype="<f4")
                parts += [x, np.zeros(-len(x) % 256, dtype="<f4")]
            np.concatenate(parts).tofile(path)
            files.append(path)
        # Files are already in the chosen layout; run_bucket reads them as they are.
        joined[(model, step)] = [{"files": files, "elements": sum(d["elements"] for d in dumps), "raw": True}]
    return joined


def main():
    args = parse_args()
    sets = load_sets(args)
    if args.joint and args.step_budget:
        raise SystemExit("--joint and --step-budget are two ways to share one budget: pick one")
    budgets = {}  # (set, bucket index) -> {b: b̄}
    if args.step_budget:
        for (model, step), dumps in sorted(sets.items()):
            shape = [d["elements"] for d in dumps]
            earlier = [st for (m, st), ds in sets.items()
                       if m == model and [d["elements"] for d in ds] == shape and
                       (st < step if args.plan_from == "previous" else st == step)]
            if earlier:
                plan = step_budgets(args, sets[(model, max(earlier))])
                for k in range(len(dumps)):
                    budgets[((model, step), k)] = {b: v[k] for b, v in plan.items()}
        sets = {s: d for s, d in sets.items() if (s, 0) in budgets}
        if not sets:
            raise SystemExit("--step-budget: no set has an earlier dump of the same buckets")
    wanted_steps = {int(s) for s in args.steps.split(",") if s}
    if wanted_steps:
        sets = {s: d for s, d in sets.items() if s[1] in wanted_steps}
    if args.joint:
        sets = join_buckets(args, sets)
    bits = [float(b) for b in args.bits.split(",") if b]
    jobs = [(s, k, d) for s, dumps in sorted(sets.items()) for k, d in enumerate(dumps)]
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda j: run_bucket(args, j[2], budgets.get((j[0], j[1]))), jobs))
    by_set = {}
    for (s, _, _), r in zip(jobs, results):
        by_set.setdefault(s, []).append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({f"{m} s{st}": b for (m, st), b in by_set.items()}, f)
    summary = []
    fmt = lambda v: f"{v:.2e}"
    print(f"All-reduce of {args.workers} ranks, {args.topology}, {args.trials} trial(s); vNMSE weighted by energy "
          f"over each set's buckets of >= {args.min_elements} elements.\n")
    for (model, step), buckets in sorted(by_set.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        c = combine(buckets)
        n = sum(b["elements"] for b in buckets)
        sent = sum(b["sent"] for b in buckets)
        how = ("joint budget over the buckets" if args.joint else
               f"{len(buckets)} bucket(s), one budget per step" if args.step_budget else f"{len(buckets)} bucket(s)")
        print(f"### {model}, step {step}: {how}, {n:,} elements per rank"
              f"{f' ({sent:,} sent, aligned)' if args.layout == 'aligned' else ''}\n")
        print("| codec | " + " | ".join(f"{b:g} b" for b in bits) + " |")
        print("|---" * (len(bits) + 1) + "|")
        for codec, label in (("dynamiq", "DynamiQ (b̄, all metadata)"), ("uniform", "uniform (b + 0.5 b)")):
            if any((codec, b) in c for b in bits):
                print(f"| {label} | " + " | ".join(fmt(c[(codec, b)][0]) if (codec, b) in c else "-" for b in bits) +
                      " |")
                if codec == "dynamiq":  # what the step actually sent (per original coordinate)
                    print("| DynamiQ wire bits | " +
                          " | ".join(f"{c[(codec, b)][1]:.2f}" if (codec, b) in c else "-" for b in bits) + " |")
        fixed = [f for f in FIXED if (f, None) in c]
        if fixed:
            print("\n| codec | wire bits | vNMSE |\n|---|---|---|")
            for f in fixed:
                print(f"| {f} | {c[(f, None)][1]:.2f} | {fmt(c[(f, None)][0])} |")
        print()
        mx = c.get(("mxfp8", None), (None,))[0]
        summary.append((model, step, c.get(("dynamiq", 4.0), (None,))[0], c.get(("dynamiq", 5.0), (None,))[0], mx))
    print("### Summary: issue-20 targets (ring n=8)\n")
    print("| set | DynamiQ 4 | DynamiQ 5 | MXFP8 | DQ4 / MXFP8 (target <= 1) | DQ5 / MXFP8 (target) |")
    print("|---|---|---|---|---|---|")
    for model, step, dq4, dq5, mx in summary:
        if None in (dq4, dq5, mx):
            continue
        target = 0.5 if is_transformer(model) else 0.3 if model == "cnn" else None
        mark = lambda ok: "" if ok else " **miss**"
        t5 = f"<= {target}{mark(dq5 <= target * mx)}" if target else "none"
        print(f"| {model} s{step} | {fmt(dq4)} | {fmt(dq5)} | {fmt(mx)} | {dq4 / mx:.2f}{mark(dq4 <= mx)} | "
              f"{dq5 / mx:.2f} ({t5}) |")

if __name__ == "__main__":
    main()
