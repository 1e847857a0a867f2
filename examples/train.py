#!/usr/bin/env python3
"""Data-parallel training through dynamiq (or torch's own Gloo all-reduce, for comparison).

Launcher (default): starts one dynamiqd per node on loopback (free ports, sockets in a temporary
directory) unless --sockets names running ones, runs --workers-per-node worker processes per node,
prints per-step progress on stderr and a summary (or, with --json, one JSON object) on stdout:

    examples/train.py --nodes 2 --workers-per-node 2 --comm dynamiq --codec dynamiq --bits 5
    examples/train.py --nodes 2 --workers-per-node 2 --comm gloo --json

Worker (--worker): one training process configured like torchrun does (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) plus the DQ_* variables for its node's
dynamiqd, so torchrun or a network-namespace harness can start the workers itself:

    DQ_SOCKET=/run/dq0.sock torchrun --nproc_per_node=2 ... examples/train.py --worker --comm dynamiq

Every worker builds the same model, DDP broadcasts rank 0's parameters over the Gloo process group,
and gradients go through dynamiq.torch.allreduce_hook (--comm dynamiq) or DDP's built-in Gloo
all-reduce (--comm gloo). The global batch (--batch-size) is split evenly across workers, so runs
with different worker counts follow the same data order.

Task `digits`: scikit-learn's bundled 8x8 digits (Debian python3-sklearn; 1797 images, a fixed
split of 1437 train / 360 test), an MLP 64-H-H-10 trained with SGD + momentum.

JSON fields: the configuration, per-step `loss` and `train_accuracy` (averaged over all workers'
shares of the global batch), `eval` (test loss/accuracy every --eval-every steps and at the end),
`final_test_accuracy`, `final_test_loss`, `steps_per_second` (rank 0's training-step time, without
evaluation and the first --timing-skip steps), `wire_bytes_per_step` (bytes node 0 sent to other
nodes, reported by the daemon) and, with --record-error, per-step `vnmse` of the daemon's result
against an exact all-reduce of the same gradients.
"""

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------------------------
# Command line


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="digits", choices=["digits"], help="what to train (default digits)")
    p.add_argument("--comm", default="dynamiq", choices=["dynamiq", "gloo"],
                   help="gradient all-reduce: dynamiq (DDP hook through dynamiqd) or gloo (torch DDP's own)")
    p.add_argument("--nodes", type=int, default=1, help="launcher: nodes, one dynamiqd each (default 1)")
    p.add_argument("--workers-per-node", type=int, default=2, help="launcher: worker processes per node (default 2)")
    p.add_argument("--codec", default="dynamiq",
                   help="dynamiq codec: none, bf16, dynamiq, mxfp8, mxfp6, mxfp4, thc, uniform (default dynamiq)")
    p.add_argument("--bits", type=float, default=0,
                   help="codec bits (dynamiq: average bits/coord 3..8); 0: the codec's default (dynamiq 5)")
    p.add_argument("--topology", default="ring", help="ring or butterfly (default ring)")
    p.add_argument("--min-compress-elements", type=int, default=4096,
                   help="buckets with fewer elements travel uncompressed (default 4096)")
    p.add_argument("--warmup-steps", type=int, default=0,
                   help="first steps all-reduced exactly over the Gloo process group (default 0)")
    p.add_argument("--record-error", action="store_true",
                   help="measure per-step vNMSE against an exact all-reduce (a second, uncompressed all-reduce)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data order (default 0)")
    p.add_argument("--batch-size", type=int, default=128,
                   help="global batch size, split evenly across workers (default 128)")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--hidden", type=int, default=256, help="MLP hidden width (default 256)")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP bucket size cap in MB (default 25)")
    p.add_argument("--eval-every", type=int, default=50, help="test-set evaluation period in steps (default 50)")
    p.add_argument("--log-every", type=int, default=10, help="progress line period in steps (default 10)")
    p.add_argument("--timing-skip", type=int, default=5,
                   help="first steps left out of steps_per_second (DDP bucket rebuild, connections)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object with the results on stdout")
    p.add_argument("--timeout", type=float, default=600, help="launcher: seconds before giving up (default 600)")
    p.add_argument("--dynamiqd", default=None,
                   help="launcher: dynamiqd binary (default $DYNAMIQD, build/bin/dynamiqd, then PATH)")
    p.add_argument("--dynamiqd-arg", action="append", default=[], metavar="FLAG",
                   help="launcher: extra flag for every dynamiqd it starts (repeatable), e.g. "
                        "--dynamiqd-arg=--error_sample_rate=1")
    p.add_argument("--sockets", default=None,
                   help="launcher: comma-separated worker sockets of running dynamiqds, one per node "
                        "(the codec options then go through --control)")
    p.add_argument("--control", default=None,
                   help="host:port of a running dynamiqd's operator API; with --sockets, the codec options are "
                        "applied to the job through it")
    p.add_argument("--job", default=None, help="dynamiq job id (default: unique per launch)")
    p.add_argument("--worker", action="store_true", help="run one worker (torchrun-style environment)")
    p.add_argument("--init-method", default="env://", help="worker: torch.distributed init method (default env://)")
    p.add_argument("--result-file", default=None, help="worker: rank 0 writes the JSON result here")
    args = p.parse_args(argv)
    if args.nodes < 1 or args.workers_per_node < 1:
        p.error("--nodes and --workers-per-node must be at least 1")
    if args.steps < 1:
        p.error("--steps must be at least 1")
    if args.record_error and args.comm != "dynamiq":
        p.error("--record-error measures dynamiq's error: it needs --comm dynamiq")
    return args


# ---------------------------------------------------------------------------------------------
# Worker


def load_digits():
    """The digits dataset as float32 tensors with a fixed train/test split."""
    import numpy as np
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as e:
        raise SystemExit("task digits needs scikit-learn's bundled dataset: apt-get install python3-sklearn "
                         f"({e})")
    import torch
    data = sk_load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(12345).permutation(len(y))  # fixed split, independent of --seed
    test, train = order[:360], order[360:]
    return (torch.from_numpy(x[train]), torch.from_numpy(y[train]),
            torch.from_numpy(x[test]), torch.from_numpy(y[test]))


def make_model(args):
    import torch
    torch.manual_seed(args.seed)
    return torch.nn.Sequential(
        torch.nn.Linear(64, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 10))


def global_batches(n, batch_size, seed):
    """Yields the global batch indices of each step: epochs of a seeded permutation."""
    import numpy as np
    epoch = 0
    while True:
        order = np.random.default_rng([seed, epoch]).permutation(n)
        for start in range(0, n - batch_size + 1, batch_size):
            yield order[start:start + batch_size]
        epoch += 1


def evaluate(model, x, y):
    import torch
    with torch.no_grad():
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(1) == y).float().mean().item()
    return loss, accuracy


def log(message):
    print(message, file=sys.stderr, flush=True)


def run_worker(args):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(args.threads)
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.batch_size % world != 0:
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by the {world} workers")
    dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=world)

    x_train, y_train, x_test, y_test = load_digits()
    model = make_model(args)
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    state = None
    if args.comm == "dynamiq":
        import dynamiq.torch
        codec_options = {}
        if args.control:  # the launcher did not start the daemons with these options
            codec_options = dict(codec=args.codec, bits=args.bits, topology=args.topology,
                                 min_compress_elements=args.min_compress_elements, control=args.control)
        state = dynamiq.torch.DynamiqState(warmup_steps=args.warmup_steps, record_error=args.record_error,
                                           **codec_options)
        ddp.register_comm_hook(state, dynamiq.torch.allreduce_hook)
        if rank == 0:
            c = state.client.config
            log(f"dynamiq job {state.client.job}: node {state.client.node_rank}/{state.client.num_nodes}, "
                f"codec at registration {c.codec} bits {c.bits:g} min_compress {c.min_compress_elements}")
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=args.momentum)

    share = args.batch_size // world
    batches = global_batches(len(y_train), args.batch_size, args.seed)
    losses, accuracies, evals, step_seconds = [], [], [], []
    for step in range(args.steps):
        idx = next(batches)[rank * share:(rank + 1) * share]
        xb, yb = x_train[idx], y_train[idx]
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        logits = ddp(xb)
        loss = torch.nn.functional.cross_entropy(logits, yb)
        loss.backward()
        optimizer.step()
        step_seconds.append(time.perf_counter() - started)
        losses.append(loss.item())
        accuracies.append((logits.argmax(1) == yb).float().mean().item())
        if rank == 0 and (step + 1) % args.log_every == 0:
            log(f"step {step + 1}/{args.steps} loss {losses[-1]:.4f} batch accuracy {accuracies[-1]:.3f} "
                f"({1.0 / max(step_seconds[-1], 1e-9):.1f} steps/s)")
        if rank == 0 and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            test_loss, test_accuracy = evaluate(model, x_test, y_test)
            evals.append({"step": step + 1, "test_loss": test_loss, "test_accuracy": test_accuracy})
            log(f"step {step + 1}: test loss {test_loss:.4f} test accuracy {test_accuracy:.4f}")

    # Per-step values of every worker, averaged on rank 0 (one collective, after the timing).
    gathered = [None] * world
    dist.all_gather_object(gathered, (losses, accuracies))
    result = None
    if rank == 0:
        timed = step_seconds[args.timing_skip:] or step_seconds
        result = {
            "task": args.task, "comm": args.comm, "world_size": world, "steps": args.steps, "seed": args.seed,
            "batch_size": args.batch_size, "lr": args.lr, "momentum": args.momentum, "hidden": args.hidden,
            "warmup_steps": args.warmup_steps,
            "loss": [sum(g[0][s] for g in gathered) / world for s in range(args.steps)],
            "train_accuracy": [sum(g[1][s] for g in gathered) / world for s in range(args.steps)],
            "eval": evals,
            "final_test_loss": evals[-1]["test_loss"],
            "final_test_accuracy": evals[-1]["test_accuracy"],
            "steps_per_second": len(timed) / sum(timed),
            "train_seconds": sum(step_seconds),
        }
        if state is not None:
            summaries = [state.step_summary(s) for s in range(args.warmup_steps, args.steps)]
            # What the daemon reported running (bits 0 on the command line means the codec's default).
            result["codec_reported"] = sorted({r["codec"] for r in state.records})
            result["bits_reported"] = sorted({r["bits"] for r in state.records})
            result["wire_bytes_per_step"] = (sum(s["wire_bytes"] for s in summaries) / len(summaries)
                                             if summaries else 0.0)
            if args.record_error:
                result["vnmse"] = [s.get("vnmse") for s in summaries]
    if state is not None:
        state.close()
    dist.destroy_process_group()
    if rank == 0:
        if args.result_file:
            tmp = args.result_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, args.result_file)
        else:
            print(json.dumps(result) if args.json else summarize(result))


# ---------------------------------------------------------------------------------------------
# Launcher


def free_ports(n):
    """n distinct free TCP ports on loopback (bound and released: another process may take one in
    between, in which case the daemon fails to listen and the launcher reports it)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def find_dynamiqd(explicit):
    for candidate in (explicit, os.environ.get("DYNAMIQD"), os.path.join(REPO, "build", "bin", "dynamiqd"),
                      shutil.which("dynamiqd")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    raise SystemExit("no dynamiqd binary: build it (scripts/build) or pass --dynamiqd / set DYNAMIQD")


def dynamiqd_flags(binary):
    """The flags `dynamiqd --help` lists (to pass optional ones only where supported)."""
    out = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30)
    text = out.stdout + out.stderr
    return {word.split("=")[0][2:] for word in text.split() if word.startswith("--")}


def wait_for_port(proc, port, log_path, timeout=60):
    """Waits until a daemon accepts TCP connections on 127.0.0.1:port."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if proc.poll() is not None:
            raise RuntimeError(f"dynamiqd exited with {proc.returncode}: {tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"dynamiqd not listening on port {port} within {timeout} s")
        time.sleep(0.02)


class LocalDaemons:
    """One dynamiqd per node on loopback, stopped with SIGTERM on close()."""

    def __init__(self, binary, nodes, directory, codec, bits, topology, min_compress_elements, extra=(), timeout=60):
        self.procs, self.sockets, self.logs = [], [], []
        try:
            ports = free_ports(nodes)
            self.control = f"127.0.0.1:{ports[0]}"
            metrics = ["--metrics_port=0"] if "metrics_port" in dynamiqd_flags(binary) else []
            for node in range(nodes):
                sock = os.path.join(directory, f"node{node}.sock")
                cmd = [binary, f"--num_nodes={nodes}", f"--node_rank={node}", f"--listen=127.0.0.1:{ports[node]}",
                       f"--worker_socket={sock}", f"--codec={codec}", f"--bits={bits}", f"--topology={topology}",
                       f"--min_compress_elements={min_compress_elements}"] + metrics + list(extra)
                if node > 0:
                    # Node 0 serves the rendezvous; a node that finds nobody listening gives up.
                    wait_for_port(self.procs[0], ports[0], self.logs[0])
                    cmd.append(f"--coordinator={self.control}")
                log_path = os.path.join(directory, f"dynamiqd{node}.log")
                with open(log_path, "w") as out:
                    self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT))
                self.sockets.append(sock)
                self.logs.append(log_path)
            deadline = time.monotonic() + timeout
            while not all(os.path.exists(s) for s in self.sockets):
                for p, path in zip(self.procs, self.logs):
                    if p.poll() is not None:
                        raise RuntimeError(f"dynamiqd exited with {p.returncode}: {tail(path)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"dynamiqd not ready within {timeout} s: {tail(self.logs[0])}")
                time.sleep(0.05)
        except BaseException:
            self.close()  # no daemon outlives a failed start
            raise

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def tail(path, lines=20):
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def summarize(result):
    codec = ",".join(result.get("codec_reported", [])) or "-"
    bits = ",".join(f"{b:g}" for b in result.get("bits_reported", [])) or "-"
    lines = [f"{result['task']} comm={result['comm']} codec={codec} bits={bits} world={result['world_size']} "
             f"steps={result['steps']} seed={result['seed']}",
             f"  final test accuracy {result['final_test_accuracy']:.4f}  test loss {result['final_test_loss']:.4f}  "
             f"last train loss {result['loss'][-1]:.4f}",
             f"  {result['steps_per_second']:.1f} steps/s"]
    if result["comm"] == "dynamiq" and result.get("nodes") == 1:
        lines.append("  one node: workers are summed exactly in shared memory (the codec runs between nodes)")
    if "wire_bytes_per_step" in result:
        lines.append(f"  {result['wire_bytes_per_step']:.0f} bytes/step sent by node 0 to other nodes")
    if result.get("vnmse"):
        v = [x for x in result["vnmse"] if x is not None]
        if v:
            lines.append(f"  vNMSE per step: mean {sum(v) / len(v):.3g}, max {max(v):.3g}")
    return "\n".join(lines)


# The flags a worker takes from the launcher's command line.
WORKER_FLAGS = ("task", "comm", "codec", "bits", "topology", "min_compress_elements", "warmup_steps", "steps", "seed",
                "batch_size", "lr", "momentum", "hidden", "bucket_cap_mb", "eval_every", "log_every", "timing_skip",
                "threads")


def worker_flags(args):
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in WORKER_FLAGS]
    if args.record_error:
        flags.append("--record-error")
    return flags


def launch(args):
    world = args.nodes * args.workers_per_node
    if args.batch_size % world != 0:
        raise SystemExit(f"--batch-size {args.batch_size} is not divisible by {world} workers")
    tmp = tempfile.mkdtemp(prefix="dynamiq-train-")
    daemons = None
    procs = []
    try:
        sockets, control = [], args.control
        if args.comm == "dynamiq":
            if args.sockets:
                sockets = args.sockets.split(",")
                if len(sockets) != args.nodes:
                    raise SystemExit(f"--sockets names {len(sockets)} sockets for {args.nodes} nodes")
            else:
                daemons = LocalDaemons(find_dynamiqd(args.dynamiqd), args.nodes, tmp, args.codec, args.bits,
                                       args.topology, args.min_compress_elements, args.dynamiqd_arg)
                sockets = daemons.sockets
                control = None  # the daemons run the job's configuration from their flags
        job = args.job or f"train-{os.getpid()}-{int(time.time())}"
        result_file = os.path.join(tmp, "result.json")
        forwarded = worker_flags(args)
        base_env = dict(os.environ)
        package = os.path.join(REPO, "build", "python")
        if "PYTHONPATH" not in base_env and os.path.isdir(package):
            base_env["PYTHONPATH"] = package
        base_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        base_env.setdefault("OMP_NUM_THREADS", str(args.threads))
        for rank in range(world):
            node, local = divmod(rank, args.workers_per_node)
            env = dict(base_env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local),
                       LOCAL_WORLD_SIZE=str(args.workers_per_node))
            if args.comm == "dynamiq":
                env.update(DQ_SOCKET=sockets[node], DQ_JOB=job, DQ_LOCAL_RANK=str(local),
                           DQ_LOCAL_WORLD_SIZE=str(args.workers_per_node))
            cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--worker",
                   f"--init-method=file://{tmp}/pg-store"]
            if control:
                cmd.append(f"--control={control}")
            if rank == 0:
                cmd.append(f"--result-file={result_file}")
            procs.append(subprocess.Popen(cmd, env=env, stdout=sys.stderr))
        deadline = time.monotonic() + args.timeout
        failed = None
        while any(p.poll() is None for p in procs):
            bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if bad:
                failed = f"worker {bad[0][0]} exited with {bad[0][1]}"
                break
            if time.monotonic() > deadline:
                failed = f"workers did not finish within {args.timeout} s"
                break
            time.sleep(0.05)
        if failed is None:
            bad = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
            if bad:
                failed = f"worker {bad[0][0]} exited with {bad[0][1]}"
        if failed is not None:
            if daemons is not None:
                for path in daemons.logs:
                    log(f"--- {path}\n{tail(path)}")
            raise SystemExit(f"train.py: {failed}")
        with open(result_file) as f:
            result = json.load(f)
        result.update(nodes=args.nodes, workers_per_node=args.workers_per_node)
        if args.comm == "dynamiq" and (daemons is not None or control):
            reported = result["bits_reported"] or [args.bits]
            result.update(codec=args.codec, bits=args.bits or reported[0], topology=args.topology,
                          min_compress_elements=args.min_compress_elements)
        elif args.comm == "dynamiq":  # running daemons with their own job defaults
            result.update(codec=",".join(result["codec_reported"]), bits=(result["bits_reported"] or [None])[0])
        result["record_error"] = args.record_error
        print(json.dumps(result) if args.json else summarize(result))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if daemons is not None:
            daemons.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main():
    args = parse_args()
    if args.worker:
        run_worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
