#!/usr/bin/python3
"""ctest link_profile: bench/link_profile.py analyze on a synthetic link counter (1 Gbit/s link,
samples every 0.5 ms) and a synthetic timeline: finds the idle milliseconds before the first
busy one, in between and after the last, and the link milliseconds lost (partly used ones too)
before it first is full, in between and after, per iteration and as medians, and skips an
iteration the samples do not cover."""

import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RATE = 125_000_000  # bytes/s


def check(cond, message):
    if not cond:
        print(f"FAIL: {message}", file=sys.stderr)
        sys.exit(1)


def main():
    # Iteration 0: 30 ms from t = 1000 s: idle 5 ms, busy 10, idle 3, busy 10, idle 2.
    # Iteration 1: 20 ms from t = 1000.05 s: half the link rate 4 ms (busy, not full), idle 6, full 10.
    # Iteration 2 lies past the last sample.
    busy = [(1000.005, 1000.015, 1), (1000.018, 1000.028, 1), (1000.050, 1000.054, 0.5), (1000.060, 1000.070, 1)]

    def counter(t):
        return sum(max(0.0, min(t, b) - a) * share for a, b, share in busy) * RATE

    with tempfile.TemporaryDirectory(prefix="link-profile-") as d:
        samples, result = os.path.join(d, "samples.txt"), os.path.join(d, "rank0.out")
        with open(samples, "w") as f:
            for i in range(200):  # 0.5 ms apart, 1000 s .. 1000.0995 s
                t = 1000 + i * 0.0005
                f.write(f"{t:.6f} {counter(t):.0f}\n")
        timeline = [[1_000_000_000, 1_000_030_000], [1_000_050_000, 1_000_070_000], [1_000_200_000, 1_000_210_000]]
        with open(result, "w") as f:
            f.write("not json\n" + json.dumps({"seconds": 0.02, "timeline_unix_us": timeline}) + "\n")
        proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "link_profile.py"), "analyze",
                               f"--samples={samples}", f"--result={result}", f"--rate_bps={RATE}"],
                              capture_output=True, text=True, timeout=60)
        check(proc.returncode == 0, f"analyze exited {proc.returncode}: {proc.stderr}")
        lines = proc.stdout.splitlines()
        check("iteration 0: 30.0 ms, idle ms: start 5, middle 3, end 2; lost ms: start 5.0, middle 3.0, end 2.0"
              in lines, proc.stdout)
        check("_____" + "#" * 10 + "___" + "#" * 10 + "__" in lines, proc.stdout)
        check("iteration 1: 20.0 ms, idle ms: start 0, middle 6, end 0; lost ms: start 8.0, middle 0.0, end 0.0"
              in lines, proc.stdout)
        check("iteration 2: not covered by the samples" in lines, proc.stdout)
        summary = json.loads(lines[-1])
        check(summary == {"link_idle_start_ms": 2.5, "link_idle_middle_ms": 4.5, "link_idle_end_ms": 1.0,
                          "link_lost_start_ms": 6.5, "link_lost_middle_ms": 1.5, "link_lost_end_ms": 1.0},
              f"summary {summary}")
    print("ok")


if __name__ == "__main__":
    main()
