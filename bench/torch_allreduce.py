#!/usr/bin/python3
"""PyTorch baseline for scripts/bench-network: an uncompressed fp32 all-reduce (SUM) over
torch.distributed's gloo backend, one process per rank, printing the same JSON line as
`dynamiq-bench allreduce` (rank 0 only unless --all_ranks_print).

Run with Debian's python3-torch (torch 1.13): /usr/bin/python3 bench/torch_allreduce.py ...
Gloo binds to the interface named by GLOO_SOCKET_IFNAME (scripts/bench-network sets it to each
namespace's veth); without it gloo resolves this host's name.

Timing: a barrier, then one all_reduce, per iteration; each iteration's time is the maximum over
ranks (one extra tiny all-reduce after the timed loop), and the median of those is reported.
The tensor is restored from a copy before every iteration, outside the timed region.
wire_bytes_per_rank is what a ring all-reduce sends per rank, 2(n-1)/n * 4 * size bytes (gloo's
own algorithm choice and TCP/IP headers are not counted); vnmse is 0 (exact fp32 sum, up to
summation order).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time


def result_row(method, codec, topology, world_size, rank, size, seconds):
    """The JSON row of an fp32 all-reduce of `size` elements per rank, as `dynamiq-bench allreduce`
    prints it (wire bytes: what a ring sends per rank, 2(n-1)/n of the tensor)."""
    bytes_per_rank = 4 * size
    algbw = bytes_per_rank / seconds / 1e9
    return {
        "method": method,
        "codec": codec,
        "bits": 32,
        "topology": topology,
        "world_size": world_size,
        "rank": rank,
        "elements": size,
        "bytes_per_rank": bytes_per_rank,
        "seconds": seconds,
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * 2 * (world_size - 1) / world_size,
        "wire_bytes_per_rank": int(2 * (world_size - 1) * bytes_per_rank // world_size),
    }


def add_run_args(p, timeout_help):
    """The flags every all-reduce script of scripts/bench-network takes (rank, size, timing, seed)."""
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world_size", type=int, required=True)
    p.add_argument("--size", type=int, default=16777216, help="fp32 elements per rank (default %(default)s)")
    p.add_argument("--iterations", type=int, default=5, help="timed all-reduces, median reported (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="untimed all-reduces first (default %(default)s)")
    p.add_argument("--timeout", type=float, default=120, help=timeout_help + " (default %(default)s)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--all_ranks_print", action="store_true", help="every rank prints its JSON line")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, "seconds for rendezvous and each collective")
    p.add_argument("--master", default="127.0.0.1", help="rank 0's IP: it hosts the TCP store (default %(default)s)")
    p.add_argument("--port", type=int, default=29500, help="TCP store port (default %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default %(default)s)")
    a = p.parse_args()
    if a.world_size < 1 or not 0 <= a.rank < a.world_size:
        p.error("need 0 <= --rank < --world_size")
    if a.size < 1 or a.iterations < 1 or a.warmup < 0:
        p.error("--size and --iterations must be positive, --warmup non-negative")

    import torch
    import torch.distributed as dist

    torch.set_num_threads(a.threads)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{a.master}:{a.port}",
        rank=a.rank,
        world_size=a.world_size,
        timeout=datetime.timedelta(seconds=a.timeout),
    )
    n = a.world_size
    g = torch.Generator().manual_seed(a.seed * 1000003 + a.rank)
    original = torch.randn(a.size, dtype=torch.float32, generator=g)
    x = torch.empty_like(original)

    for _ in range(a.warmup):
        x.copy_(original)
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
    times = []
    for _ in range(a.iterations):
        x.copy_(original)
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        times.append(time.perf_counter() - t0)
    # Per-iteration slowest rank.
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    seconds = statistics.median(t.tolist())
    dist.barrier()
    dist.destroy_process_group()

    row = result_row("torch-gloo-fp32", "torch-gloo", "gloo", n, a.rank, a.size, seconds)
    row["vnmse"] = 0.0
    if a.rank == 0 or a.all_ranks_print:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
