#!/usr/bin/python3
"""How unequal DynamiQ's ring/butterfly chunks are in bytes, and what size-balanced splitting could win.

With variable code widths, chunks of equal element counts (engine/schedule.h ChunkOf: ceil(count / n)
rounded up to 256) carry unequal bytes; every step of a ring or butterfly moves one chunk per rank at
once, so the step lasts as long as the largest chunk and the link idles for (max - mean) / max of it.
OSCAR-style balanced splitting would instead cut every pipelining block on super-group boundaries so
that the n chunks' encoded bytes are as equal as possible (optimal contiguous partition, computed
here by binary search on the largest chunk). This script evaluates both splits on DynamiQ plans —
the per-super-group widths `dynamiq-bench codec --dump_output=PREFIX` writes (PREFIX.<row>.widths, one
byte per super-group of rank 0's plan) — with the wire format's sizes (docs/wire_format.md: 256 w +
144 bits per super-group of width w > 0, plus 4 bits of width map; width 0 costs the map only). It is a
model of the link time, not a network measurement: it says how much idle time balancing can remove
at most (the link bound is the mean chunk).

    build/bin/dynamiq-bench codec --codec=dynamiq --bits=5 --dump_output=/tmp/cb [--input=...]
    bench/chunk_balance.py /tmp/cb.0.widths --ranks 4 8 --block 4194304
"""

import argparse
import sys


def sg_bits(w):
    return 4 + (256 * w + 144 if w > 0 else 0)


def equal_elements(sizes, n):
    """ChunkOf's split of one block (sizes: bits per super-group): n chunk totals."""
    count = len(sizes)
    per = -(-count // n)
    return [sum(sizes[c * per:(c + 1) * per]) for c in range(n)]


def balanced(sizes, n):
    """Contiguous split into at most n chunks minimising the largest (binary search on the bound)."""
    lo, hi = max(sizes) if sizes else 0, sum(sizes)
    def fits(bound):
        chunks, acc = 1, 0
        for s in sizes:
            if acc + s > bound:
                chunks, acc = chunks + 1, s
            else:
                acc += s
        return chunks <= n
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(mid):
            hi = mid
        else:
            lo = mid + 1
    out, acc = [], 0
    for s in sizes:
        if acc + s > lo and acc > 0:
            out.append(acc)
            acc = s
        else:
            acc += s
    out.append(acc)
    return out + [0] * (n - len(out))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("widths", nargs="+", help="PREFIX.<row>.widths files of dynamiq-bench codec --dump_output")
    p.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    p.add_argument("--block", type=int, default=4 << 20, help="pipelining block in elements (default 4194304, the engine's)")
    args = p.parse_args(argv)
    print("| widths | ranks | mean width | equal-element: max/mean chunk | idle | balanced: max/mean | idle | "
          "time saved |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for path in args.widths:
        with open(path, "rb") as f:
            widths = list(f.read())
        if not widths:
            sys.exit(f"{path}: empty")
        sizes = [sg_bits(w) for w in widths]
        per_block = max(1, args.block // 256)
        for n in args.ranks:
            eq_max = eq_mean = bal_max = 0.0
            for b in range(0, len(sizes), per_block):
                block = sizes[b:b + per_block]
                eq, bal = equal_elements(block, n), balanced(block, n)
                eq_max += max(eq)
                bal_max += max(bal)
                eq_mean += sum(block) / n
            print(f"| {path} | {n} | {sum(widths) / len(widths):.2f} | {eq_max / eq_mean:.3f} | "
                  f"{1 - eq_mean / eq_max:.1%} | {bal_max / eq_mean:.3f} | {1 - eq_mean / bal_max:.1%} | "
                  f"{1 - bal_max / eq_max:.1%} |")


if __name__ == "__main__":
    main()
