#!/usr/bin/python3
"""A plain TCP ring all-reduce (fp32 SUM) for scripts/bench-network: the reference of what the
kernel's TCP alone costs on the benchmark's links, next to torch's Gloo and dynamiq's own ring.

No Gloo, no framing, no checksums: each rank holds one blocking TCP connection to its right
neighbour and one from its left. Reduce-scatter: n - 1 steps, each sending one chunk to the right
while receiving the left's chunk into a scratch buffer that is then added in place (numpy);
all-gather: n - 1 steps receiving straight into the tensor. A sender thread per rank keeps both
directions busy. Chunks are equal splits of the tensor (like Gloo's ring); one connection per
direction, TCP_NODELAY. It only reduces fp32 and trusts its peers: a measuring stick, not a
transport.

Same flags and JSON line as bench/torch_allreduce.py (rank 0 only unless --all_ranks_print), plus
--peers (every rank's IP, in rank order; each rank listens on its own IP at --port). Timing: a
ring barrier, then one all-reduce, per iteration; rank 0's own median is reported (as dynamiq-bench
does). vnmse: rank 0's result against the exact sum of every rank's input (regenerated from the
seeds).
"""
import argparse
import json
import queue
import socket
import statistics
import sys
import threading
import time

import numpy as np

from torch_allreduce import add_run_args, result_row  # shared flags and JSON row; torch is imported only by its main()


def inputs_of(rank, size, seed):
    return np.random.default_rng(seed * 1000003 + rank).standard_normal(size, dtype=np.float32)


def connect_ring(a, peers):
    """(to the right, from the left) sockets; the deadline bounds connecting and accepting."""
    deadline = time.monotonic() + a.timeout
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((peers[a.rank], a.port))
    listener.listen(1)
    listener.settimeout(a.timeout)
    right = peers[(a.rank + 1) % a.world_size]
    out = None
    while out is None:
        try:
            out = socket.create_connection((right, a.port), timeout=max(0.1, deadline - time.monotonic()))
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {a.rank}: no connection to {right}:{a.port} within {a.timeout} s")
            time.sleep(0.05)
    inp, _ = listener.accept()
    listener.close()
    for s in (out, inp):
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(a.timeout)
    return out, inp


def recv_exactly(sock, view):
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError("peer closed the connection")
        got += n


class Sender:
    """Sends queued buffers to the right neighbour on its own thread."""

    def __init__(self, sock):
        self.sock, self.jobs, self.done = sock, queue.Queue(), queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        while True:
            view = self.jobs.get()
            if view is None:
                return
            try:
                self.sock.sendall(view)
                self.done.put(None)
            except OSError as e:
                self.done.put(e)

    def send(self, view):
        self.jobs.put(view)

    def wait(self, timeout):
        error = self.done.get(timeout=timeout)
        if error is not None:
            raise error

    def close(self):
        self.jobs.put(None)
        self.thread.join(timeout=5)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(p, "seconds for connecting and each socket wait")
    p.add_argument("--peers", required=True, help="comma-separated IPs of ranks 0..n-1")
    p.add_argument("--port", type=int, default=29500, help="port every rank listens on (default %(default)s)")
    a = p.parse_args()
    peers = a.peers.split(",")
    n = a.world_size
    if n < 2 or len(peers) != n or not 0 <= a.rank < n:
        p.error("need --world_size >= 2, one --peers entry per rank and 0 <= --rank < --world_size")
    if a.size < n or a.iterations < 1 or a.warmup < 0:
        p.error("--size must be at least --world_size, --iterations positive, --warmup non-negative")

    out, inp = connect_ring(a, peers)
    sender = Sender(out)
    bounds = np.linspace(0, a.size, n + 1).astype(np.int64)
    chunk = lambda c: slice(bounds[c], bounds[c + 1])
    original = inputs_of(a.rank, a.size, a.seed)
    x = np.empty_like(original)
    scratch = np.empty(int(np.max(np.diff(bounds))), dtype=np.float32)
    token, one = bytearray(1), memoryview(bytearray(1))

    def barrier():  # n - 1 hops of a token: every rank has entered once its own returns
        for _ in range(n - 1):
            sender.send(one)
            recv_exactly(inp, memoryview(token))
            sender.wait(a.timeout)

    def all_reduce():
        r = a.rank
        for s in range(n - 1):
            sc, rc = (r - s) % n, (r - s - 1) % n
            sender.send(memoryview(x[chunk(sc)]).cast("B"))
            part = scratch[: bounds[rc + 1] - bounds[rc]]
            recv_exactly(inp, memoryview(part).cast("B"))
            sender.wait(a.timeout)
            x[chunk(rc)] += part
        for s in range(n - 1):
            sc, rc = (r + 1 - s) % n, (r - s) % n
            sender.send(memoryview(x[chunk(sc)]).cast("B"))
            recv_exactly(inp, memoryview(x[chunk(rc)]).cast("B"))
            sender.wait(a.timeout)

    for _ in range(a.warmup):
        x[:] = original
        all_reduce()
    times = []
    for _ in range(a.iterations):
        x[:] = original
        barrier()
        t0 = time.perf_counter()
        all_reduce()
        times.append(time.perf_counter() - t0)
    barrier()
    sender.close()
    out.close()
    inp.close()

    row = result_row("tcp-ring-fp32", "tcp-ring", "ring", n, a.rank, a.size, statistics.median(times))
    if a.rank == 0 or a.all_ranks_print:
        exact = np.zeros(a.size, dtype=np.float64)
        for q in range(n):
            exact += inputs_of(q, a.size, a.seed)
        row["vnmse"] = float(np.sum((x - exact) ** 2) / np.sum(exact**2))
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
