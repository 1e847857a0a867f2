"""Where an all-reduce leaves its link idle: scripts/bench-network --link-profile.

  sample   runs inside rank 0's network namespace and records the byte counter of its shaped link
           (/sys/class/net/DEV/statistics/tx_bytes: what left through tc) every --interval seconds
           until --stop exists, the device is gone, or --limit seconds pass. One "time bytes" line
           per sample. The sampler costs some CPU; compare profiled runs with profiled runs.
  analyze  lines the samples up with rank 0's timed iterations (dynamiq-bench --timeline) and
           prints, per iteration, 1 ms bins of the link's rate as a strip (# >= 85% of the link
           rate, + >= 50%, . >= 15%, _ idle) and the idle milliseconds: before the first busy
           bin (start), after the last (end) and in between (middle); and the link milliseconds
           lost, which also counts partly used bins: elapsed time minus bytes / the saturated
           rate (the median rate of 10 ms windows whose bins are all at >= 85% of the link rate:
           what the link carries once it is full, headers counted as the counter sees them),
           split into before the first saturated bin (start), after the last one (end) and in
           between (middle). Its last line is a JSON object with the medians over iterations,
           which bench-network adds to the method's row.

Stdlib only, run with /usr/bin/python3.
"""
import argparse
import bisect
import json
import os
import statistics
import sys
import time


def sample(a):
    counter = f"/sys/class/net/{a.dev}/statistics/tx_bytes"
    deadline = time.monotonic() + a.limit
    with open(a.out, "w") as out:
        while time.monotonic() < deadline and not os.path.exists(a.stop):
            try:
                with open(counter) as f:
                    value = int(f.read())
            except OSError:  # the namespace is gone
                break
            out.write(f"{time.time():.6f} {value}\n")
            time.sleep(a.interval)


def analyze(a):
    samples = [tuple(map(float, line.split())) for line in open(a.samples) if line.strip()]
    times = [t for t, _ in samples]
    row = json.loads([line for line in open(a.result) if line.startswith("{")][-1])
    per_ms = a.rate_bps / 1000.0  # bytes the link can carry in 1 ms
    summary = {"start": [], "middle": [], "end": []}
    lost_summary = {"start": [], "middle": [], "end": []}

    def bytes_at(t):  # the counter at time t, linearly interpolated
        i = bisect.bisect_left(times, t)
        if i < len(samples) and times[i] == t:
            return samples[i][1]
        if i == 0 or i >= len(samples):
            return None
        (t0, b0), (t1, b1) = samples[i - 1], samples[i]
        return b0 + (b1 - b0) * (t - t0) / (t1 - t0) if t1 > t0 else b1

    for it, (begin_us, end_us) in enumerate(row.get("timeline_unix_us", [])):
        begin, end = begin_us / 1e6, end_us / 1e6
        bins = []
        for j in range(int(round((end - begin) * 1000))):
            lo, hi = bytes_at(begin + j * 0.001), bytes_at(begin + (j + 1) * 0.001)
            if lo is None or hi is None:
                bins = None
                break
            bins.append((hi - lo) / per_ms)
        if not bins:
            print(f"iteration {it}: not covered by the samples")
            continue
        idle = [f < 0.15 for f in bins]
        busy = [i for i, x in enumerate(idle) if not x]
        start = busy[0] if busy else len(bins)
        end_idle = len(bins) - 1 - busy[-1] if busy else 0
        middle = sum(idle) - start - end_idle
        for k, v in (("start", start), ("middle", middle), ("end", end_idle)):
            summary[k].append(v)
        full = [i for i, f in enumerate(bins) if f >= 0.85]
        # 10 ms windows of saturated bins average out the counter's jitter and the shaper's bursts.
        windows = [sum(bins[i:i + 10]) / 10 for i in range(len(bins) - 9) if min(bins[i:i + 10]) >= 0.85]
        saturated = statistics.median(windows) if windows else 1.0
        lost = [1.0 - f / saturated for f in bins]  # ms per 1 ms bin; < 0 in a burst
        first, last = (full[0], full[-1]) if full else (len(bins), len(bins) - 1)
        lost_parts = {k: round(sum(v), 2) + 0.0  # + 0.0: no "-0.0"
                      for k, v in (("start", lost[:first]), ("middle", lost[first:last + 1]), ("end", lost[last + 1:]))}
        for k, v in lost_parts.items():
            lost_summary[k].append(v)
        strip = "".join("#" if f >= 0.85 else "+" if f >= 0.5 else "." if f >= 0.15 else "_" for f in bins)
        print(f"iteration {it}: {1000 * (end - begin):.1f} ms, idle ms: start {start}, middle {middle}, "
              f"end {end_idle}; lost ms: start {lost_parts['start']:.1f}, middle {lost_parts['middle']:.1f}, "
              f"end {lost_parts['end']:.1f}")
        print(strip)
    if not summary["start"]:
        print(json.dumps({}))
        return 1
    medians = {f"link_idle_{k}_ms": statistics.median(v) for k, v in summary.items()}
    medians.update({f"link_lost_{k}_ms": statistics.median(v) for k, v in lost_summary.items()})
    print(json.dumps(medians))
    return 0


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("sample")
    s.add_argument("--dev", default="dq0")
    s.add_argument("--out", required=True)
    s.add_argument("--stop", required=True, help="stop once this file exists")
    s.add_argument("--limit", type=float, default=600, help="seconds at most (default %(default)s)")
    s.add_argument("--interval", type=float, default=0.0005, help="seconds between samples (default %(default)s)")
    z = sub.add_parser("analyze")
    z.add_argument("--samples", required=True)
    z.add_argument("--result", required=True, help="rank 0's stdout (a JSON line with timeline_unix_us)")
    z.add_argument("--rate_bps", type=float, required=True, help="link rate in bytes/s")
    a = p.parse_args()
    return sample(a) if a.command == "sample" else analyze(a)


if __name__ == "__main__":
    sys.exit(main() or 0)
