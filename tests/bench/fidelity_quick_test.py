#!/usr/bin/python3
"""ctest fidelity_quick: `bench/fidelity --quick` end to end (two 30-step examples/train.py runs on
digits, codecs none and dynamiq-5, 2 nodes x 2 workers through real dynamiqd daemons), then checks
what it wrote: raw JSON per run, summary.json with finite numbers that make sense for each codec,
report.md with both rows, and the two PNG plots. Needs DYNAMIQD and PYTHONPATH (ctest sets them)."""

import json
import math
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def check(cond, message):
    if not cond:
        print(f"FAIL: {message}", file=sys.stderr)
        sys.exit(1)


def main():
    with tempfile.TemporaryDirectory(prefix="fidelity-quick-") as out:
        proc = subprocess.run([os.path.join(REPO, "bench", "fidelity"), "--quick", f"--out={out}",
                               "--run-timeout=150", "--deadline-minutes=5"],
                              capture_output=True, text=True, timeout=400)
        check(proc.returncode == 0, f"bench/fidelity exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        for name in ("digits_none_seed0.json", "digits_dynamiq-5_seed0.json"):
            path = os.path.join(out, "raw", name)
            check(os.path.isfile(path), f"{path} missing")
            run = json.load(open(path))
            check(len(run["loss"]) == 30 and len(run["vnmse"]) == 30, f"{name}: 30 steps of loss and vNMSE")
            check(all(math.isfinite(x) for x in run["loss"] + run["vnmse"]), f"{name}: non-finite values")
        summary = json.load(open(os.path.join(out, "summary.json")))
        rows = {r["codec"]: r for r in summary["tasks"]["digits"]["rows"]}
        check(set(rows) == {"none", "dynamiq-5"}, f"rows {sorted(rows)}")
        for codec, r in rows.items():
            for key in ("accuracy_mean", "loss_mean", "vnmse_mean", "wire_bytes_per_step", "accuracy_ratio"):
                check(math.isfinite(r[key]), f"{codec} {key} = {r[key]}")
            # 30 steps of SGD on digits already get well above chance (0.1).
            check(r["accuracy_mean"] > 0.5, f"{codec} accuracy {r['accuracy_mean']}")
        none, dq = rows["none"], rows["dynamiq-5"]
        check(none["vnmse_max"] < 1e-9, f"codec none must be exact, vNMSE {none['vnmse_max']}")
        check(0 < dq["vnmse_mean"] < 2e-2, f"dynamiq-5 mean vNMSE {dq['vnmse_mean']}")
        check(0.1 < dq["wire_ratio"] < 0.25, f"dynamiq-5 wire bytes / none {dq['wire_ratio']}")
        check(none["codec_reported"] == ["none"] and dq["codec_reported"] == ["dynamiq"] and
              dq["bits_reported"] == [5.0], f"reported codecs {none['codec_reported']} {dq['codec_reported']}")
        check(abs(dq["accuracy_ratio"] - dq["accuracy_mean"] / none["accuracy_mean"]) < 1e-12, "ratio")
        report = open(os.path.join(out, "report.md")).read()
        check("| none | 1 |" in report and "| dynamiq-5 | 1 |" in report, "report.md rows")
        for png in ("digits_curves.png", "digits_vnmse.png"):
            path = os.path.join(out, png)
            check(os.path.isfile(path), f"{png} missing")
            with open(path, "rb") as f:
                check(f.read(8) == b"\x89PNG\r\n\x1a\n", f"{png} is not a PNG")
            check(10_000 < os.path.getsize(path) < 200_000, f"{png}: {os.path.getsize(path)} bytes")
    print("fidelity_quick: ok")


if __name__ == "__main__":
    main()
