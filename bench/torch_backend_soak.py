"""A long DDP run on the torch backend ("dynamiq") against two dynamiqd nodes on loopback: does the
daemons' memory stay flat, and does every collective after the first steps compress? (Issue 42,
items 5 and 6: the backend once named every call anew, so per-name state in the daemon grew
without bound and arc_topk's error feedback never compressed.)

    PYTHONPATH=build/python /usr/bin/python3 bench/torch_backend_soak.py --mode ef --steps 1000
    PYTHONPATH=build/python /usr/bin/python3 bench/torch_backend_soak.py --mode budget --steps 1000

Modes: `ef` runs codec arc_topk (density --density) with --arc_topk_error_feedback=true; `budget`
runs codec dynamiq at --bits with --step_budget. One worker per node trains an MLP of 0.53 M
parameters under DDP without a hook (several buckets: bucket_cap_mb=0.5).

Checks (exit status 1 if one fails), printed with the numbers as one JSON object:
  - compression: every call from step 3 on sends less than --max-wire-fraction of 4 bytes per
    element (torch 1.13's DDP all-reduces one bucket of all parameters in step 1 and its rebuilt
    buckets from step 2, whose names are new there; error feedback's first step of a name is dense);
  - names: the buckets' names repeat every step (the learned period is the number of buckets);
  - memory: each daemon's RSS, sampled every --sample-seconds from step 50 (or a tenth of the run)
    on, does not trend upward: the median of the last fifth of the samples is within --rss-slack-mb
    of the median of the second fifth.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# RSS samples count from this step on (the daemons' buffers, pools and states are in place).
WARMUP_STEPS = 50


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def wait_until(predicate, seconds, what):
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} within {seconds} s")
        time.sleep(0.05)


def start_daemons(binary, directory, flags):
    """Two dynamiqd on loopback; returns (procs, sockets)."""
    procs, sockets = [], []
    control = f"127.0.0.1:{free_port()}"
    for node in range(2):
        sock = os.path.join(directory, f"n{node}.sock")
        cmd = [binary, "--num_nodes=2", f"--node_rank={node}", f"--worker_socket={sock}", "--timeout=60",
               "--metrics_port=0"] + [f"--{k}={v}" for k, v in flags.items()]
        cmd.append(f"--listen={control}" if node == 0 else f"--listen=127.0.0.1:{free_port()}")
        if node == 1:
            cmd.append(f"--coordinator={control}")
            host, port = control.split(":")
            wait_until(lambda: socket.socket().connect_ex((host, int(port))) == 0, 30, "node 0 not listening")
        log = open(os.path.join(directory, f"dynamiqd{node}.log"), "w")
        procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        sockets.append(sock)
    wait_until(lambda: all(os.path.exists(s) for s in sockets), 30, "daemons not ready")
    time.sleep(0.5)
    return procs, sockets


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def worker(out_dir, steps):
    import torch
    import torch.distributed as dist

    import dynamiq.torch  # noqa: F401 -- registers the backend

    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    dist.init_process_group("dynamiq", init_method=f"file://{out_dir}/store", rank=rank, world_size=2)
    pg = dynamiq.torch.get_process_group()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                              torch.nn.Linear(512, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    teacher = torch.randn(256, 10, generator=torch.Generator().manual_seed(123))  # labels a model can learn
    g = torch.Generator().manual_seed(rank)
    boundaries, losses = [], []
    for step in range(steps):
        if rank == 0 and step == min(WARMUP_STEPS, steps // 10):
            open(os.path.join(out_dir, "warm"), "w").close()
        x = torch.randn(32, 256, generator=g)
        y = (x @ teacher).argmax(1)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        boundaries.append(len(pg.records))
        losses.append(float(loss))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        period = getattr(getattr(pg, "_names", None), "period", None)  # None: a backend without learned names
        json.dump({"records": list(pg.records), "boundaries": boundaries, "period": period, "losses": losses}, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=("ef", "budget"), default="ef")
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--density", type=float, default=0.05, help="arc_topk's density (--mode ef)")
    ap.add_argument("--bits", type=float, default=4, help="DynamiQ's bits (--mode budget)")
    ap.add_argument("--max-wire-fraction", type=float, default=None,
                    help="most wire bytes per call, as a fraction of 4 bytes per element (default 0.3 for ef, "
                         "0.2 for budget)")
    ap.add_argument("--rss-slack-mb", type=float, default=2.0)
    ap.add_argument("--sample-seconds", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=1800, help="the most the run may take, in seconds")
    ap.add_argument("--dynamiqd", default=os.environ.get("DYNAMIQD", os.path.join(REPO, "build", "bin", "dynamiqd")))
    ap.add_argument("--worker", metavar="OUT_DIR", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.steps)
        return 0
    if args.mode == "ef":
        flags = {"codec": "arc_topk", "bits": args.density, "arc_topk_error_feedback": "true",
                 "min_compress_elements": 0}
        fraction = 0.3 if args.max_wire_fraction is None else args.max_wire_fraction
    else:
        flags = {"codec": "dynamiq", "bits": args.bits, "step_budget": "true", "min_compress_elements": 0}
        fraction = 0.2 if args.max_wire_fraction is None else args.max_wire_fraction
    directory = tempfile.mkdtemp(prefix="dqtorchsoak-")
    procs, sockets = start_daemons(args.dynamiqd, directory, flags)
    samples = [[] for _ in procs]
    done = threading.Event()

    def sample():
        warm = os.path.join(directory, "warm")
        while not done.is_set():
            for i, p in enumerate(procs):
                mb = rss_mb(p.pid)
                if mb is not None and os.path.exists(warm):
                    samples[i].append((time.monotonic(), mb))
            done.wait(args.sample_seconds)

    sampler = threading.Thread(target=sample, daemon=True)
    workers = []
    started = time.monotonic()
    try:
        sampler.start()
        for rank in range(2):
            env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", DQ_SOCKET=sockets[rank], DQ_JOB="soak",
                       DQ_LOCAL_RANK="0", DQ_LOCAL_WORLD_SIZE="1", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
            workers.append(subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", directory,
                                             "--steps", str(args.steps)], env=env))
        for w in workers:
            w.wait(timeout=max(1.0, args.timeout - (time.monotonic() - started)))
    except subprocess.TimeoutExpired:
        for w in workers:
            w.kill()
        raise
    finally:
        done.set()
        sampler.join()
        stop(procs)
    seconds = time.monotonic() - started
    failures = []
    if any(w.returncode != 0 for w in workers):
        failures.append(f"worker exit codes {[w.returncode for w in workers]}")
    results = []
    for rank in range(2):
        path = os.path.join(directory, f"rank{rank}.json")
        if os.path.exists(path):
            with open(path) as f:
                results.append(json.load(f))
    summary = {"mode": args.mode, "steps": args.steps, "flags": flags, "seconds": round(seconds, 1)}
    if len(results) == 2:
        x = results[0]
        records, boundaries = x["records"], x["boundaries"]
        per_step = boundaries[1] - boundaries[0]
        late = records[boundaries[1]:]  # from step 3 on
        worst = max(r["wire_bytes"] / (4 * r["elements"]) for r in late)
        names = [r["name"] for r in late]
        summary.update({
            "calls": len(records), "buckets_per_step": per_step, "learned_period": x["period"],
            "bucket_elements": [r["elements"] for r in records[boundaries[0]:boundaries[1]]],
            "steps12_wire_bytes_per_element": [round(r["wire_bytes"] / r["elements"], 3)
                                             for r in records[:boundaries[1]]],
            "late_wire_bytes_per_element_max": round(4 * worst, 3),
            "late_wire_bytes_per_step_mean": round(sum(r["wire_bytes"] for r in late) / max(1, len(late)) * per_step),
            "names_per_step_late": len(set(names)),
            "loss_first_last": [round(x["losses"][0], 3), round(statistics.mean(x["losses"][-20:]), 3)],
        })
        if worst >= fraction:
            failures.append(f"a call from step 3 on sent {4 * worst:.3f} bytes per element (limit {4 * fraction})")
        if x["period"] != per_step or len(set(names)) != per_step:
            failures.append(f"names do not repeat every step: period {x['period']}, {len(set(names))} names for "
                            f"{per_step} buckets")
        if [r["name"] for r in results[1]["records"]] != [r["name"] for r in records]:
            failures.append("the ranks named their collectives differently")
    else:
        failures.append("a worker wrote no records")
    rss = []
    for node, s in enumerate(samples):
        n = len(s)
        if n < 10:
            failures.append(f"node {node}: only {n} RSS samples")
            continue
        early = statistics.median(mb for _, mb in s[n // 5:2 * n // 5])
        last = statistics.median(mb for _, mb in s[4 * n // 5:])
        rss.append({"node": node, "samples": n, "warm_mb": round(s[0][1], 1), "early_median_mb": round(early, 1),
                    "late_median_mb": round(last, 1), "max_mb": round(max(mb for _, mb in s), 1)})
        if last - early > args.rss_slack_mb:
            failures.append(f"node {node}: RSS grew from a median of {early:.1f} MB to {last:.1f} MB")
    summary["rss"] = rss
    summary["failures"] = failures
    print(json.dumps(summary, indent=1))
    if not failures:
        shutil.rmtree(directory, ignore_errors=True)
    else:
        print(f"logs in {directory}", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
