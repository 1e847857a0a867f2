#!/usr/bin/python3
"""DiLoCo-style training through the torch.distributed backend "dynamiq": every worker runs H local
AdamW steps on its own data (the inner optimizer), then the workers all-reduce the pseudo-gradient
(global parameters minus local parameters, averaged) with one dist.all_reduce, and an outer
Nesterov SGD steps the global parameters with it (Douillard et al., DiLoCo, 2023; INTELLECT-1 ran
the outer all-reduce in 8 bits). Only the outer all-reduce crosses the network, so its codec is the
job's (dynamiqd --codec/--bits): none (fp32, exact), bf16, int8, dynamiq at 3..8 bits.

Task: examples/train.py's byte-level LM (--task lm there: license texts, a pre-norm transformer);
each worker draws its own batches (seeded by rank). Loss scalars are all-reduced exactly (below the
backend's exact_below).

Launcher (default): one dynamiqd per node on loopback, --workers-per-node workers each:

    examples/diloco.py --nodes 4 --codec dynamiq --bits 4 --outer-steps 20 --inner-steps 20 --json

On shaped network namespaces (one node per namespace, tc rate --rate): scripts/bench-diloco-network,
which runs this file's --worker mode in each namespace; `examples/diloco.py --rate 100mbit ...`
runs it (root). Worker (--worker): RANK, WORLD_SIZE, MASTER_ADDR/MASTER_PORT (or --init-method)
and the DQ_* variables, like torchrun.

JSON (rank 0): the configuration, per outer step `outer` (mean inner loss over the workers, wire
bytes node 0 sent for that outer all-reduce, the all-reduce's seconds, the daemon's codec/bits),
`eval` (validation loss/accuracy every --eval-every outer steps and at the end),
`final_val_loss`, `final_val_accuracy`, `wire_bytes_per_outer_step` (mean), `seconds` (wall time
of the training loop on rank 0, evaluation excluded), `parameters`.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import train  # noqa: E402  (examples/train.py: the LM task, the loopback daemons)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=4, help="launcher: nodes, one dynamiqd each (default 4)")
    p.add_argument("--workers-per-node", type=int, default=1, help="launcher: workers per node (default 1)")
    p.add_argument("--codec", default="dynamiq", help="outer all-reduce codec: the job's (default dynamiq)")
    p.add_argument("--bits", type=float, default=4, help="codec bits where it has a setting (default 4)")
    p.add_argument("--outer-steps", type=int, default=20, help="outer steps (default 20)")
    p.add_argument("--inner-steps", type=int, default=20, help="H: inner AdamW steps per outer step (default 20)")
    p.add_argument("--inner-lr", type=float, default=0.003, help="inner AdamW learning rate (default 0.003)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="outer SGD learning rate (default 0.7)")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="outer Nesterov momentum (default 0.9)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per worker per inner step (default 16)")
    p.add_argument("--d-model", type=int, default=64, help="transformer width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="transformer layers (default 2)")
    p.add_argument("--context", type=int, default=64, help="context length in bytes (default 64)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data (default 0)")
    p.add_argument("--eval-every", type=int, default=5, help="validation period in outer steps (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--timeout", type=float, default=900, help="launcher: seconds before giving up (default 900)")
    p.add_argument("--dynamiqd", default=None, help="launcher: dynamiqd binary (default $DYNAMIQD, build/bin)")
    p.add_argument("--dynamiqd-arg", action="append", default=[], metavar="FLAG",
                   help="launcher: extra flag for the daemons it starts (repeatable), e.g. "
                        "--dynamiqd-arg=--error_sample_rate=1 (dynamiqd measures every outer all-reduce's vNMSE)")
    p.add_argument("--rate", default=None,
                   help="run on network namespaces with links shaped to RATE (tc units, e.g. 100mbit): "
                        "runs scripts/bench-diloco-network (root)")
    p.add_argument("--worker", action="store_true", help="run one worker (torchrun-style environment)")
    p.add_argument("--init-method", default="env://", help="worker: torch.distributed init method")
    p.add_argument("--result-file", default=None, help="worker: rank 0 writes the JSON result here")
    args = p.parse_args(argv)
    if args.outer_steps < 1 or args.inner_steps < 1:
        p.error("--outer-steps and --inner-steps must be at least 1")
    # --bits is for codecs that have a bit setting; dynamiqd refuses it for the others (none, bf16, int8, mxfp*).
    if args.codec not in ("dynamiq", "thc", "uniform", "global_qsgd", "arc_topk"):
        args.bits = 0
    # What train.LmTask and train.make_lm read.
    args.task, args.lr = "lm", args.inner_lr
    return args


def flatten(params, layout):
    import torch
    offsets, total = layout
    flat = torch.zeros(total)
    for p, o in zip(params, offsets):
        flat[o:o + p.numel()] = p.detach().reshape(-1)
    return flat


def run_worker(args):
    import torch
    import torch.distributed as dist

    import dynamiq.torch

    torch.set_num_threads(args.threads)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("dynamiq", init_method=args.init_method, rank=rank, world_size=world)
    pg = dynamiq.torch.get_process_group()
    torch.manual_seed(args.seed)
    # Every worker its own data: LmTask draws a global batch and keeps share `rank`; a batch of
    # batch_size * world with share batch_size gives each worker batch_size sequences of its own.
    local_args = argparse.Namespace(**vars(args))
    local_args.batch_size = args.batch_size * world
    task = train.LmTask(local_args, rank, args.batch_size)
    model = task.model
    params = list(model.parameters())
    # Same initial parameters everywhere (make_lm seeds; broadcast makes it explicit, exactly).
    for p in params:
        dist.broadcast(p.data, src=0)
    inner = task.optimizer(params)
    # The pseudo-gradient travels as one flat tensor, super-group aligned (dynamiq.torch.aligned_layout).
    layout = dynamiq.torch.aligned_layout([p.numel() for p in params])
    offsets = layout[0]
    global_params = flatten(params, layout)
    momentum = torch.zeros_like(global_params)
    outer_log, evals = [], []
    loop_seconds = 0.0
    for outer in range(args.outer_steps):
        started = time.perf_counter()
        losses = []
        for _ in range(args.inner_steps):
            x, y = task.next_batch()
            loss, _ = task.loss_accuracy(model(x), y)
            inner.zero_grad(set_to_none=True)
            loss.backward()
            inner.step()
            losses.append(loss.item())
        # Outer step: delta = global - local, averaged over the workers through dynamiqd.
        delta = global_params - flatten(params, layout)
        records = len(pg.records)
        t0 = time.perf_counter()
        dist.all_reduce(delta, op=dist.ReduceOp.AVG)
        reduce_seconds = time.perf_counter() - t0
        # Nesterov SGD on the global parameters (torch.optim.SGD's nesterov form).
        momentum.mul_(args.outer_momentum).add_(delta)
        global_params.sub_(args.outer_lr * (delta + args.outer_momentum * momentum))
        with torch.no_grad():
            for p, o in zip(params, offsets):
                p.copy_(global_params[o:o + p.numel()].reshape(p.shape))
        mean_loss = torch.tensor([sum(losses) / len(losses)])
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)  # one element: exact (exact_below)
        loop_seconds += time.perf_counter() - started
        new = list(pg.records)[records:]
        outer_log.append({"outer_step": outer, "inner_loss": float(mean_loss[0]),
                          "wire_bytes": sum(r["wire_bytes"] for r in new), "allreduce_seconds": reduce_seconds,
                          "codec": new[-1]["codec"] if new else None, "bits": new[-1]["bits"] if new else None})
        if new and "measured_vnmse" in new[-1]:  # dynamiqd --error_sample_rate
            outer_log[-1]["measured_vnmse"] = new[-1]["measured_vnmse"]
        if rank == 0 and ((outer + 1) % args.eval_every == 0 or outer + 1 == args.outer_steps):
            val_loss, val_acc = task.evaluate(model)
            evals.append({"outer_step": outer + 1, "val_loss": val_loss, "val_accuracy": val_acc})
            train.log(f"outer {outer + 1}/{args.outer_steps}: inner loss {mean_loss[0]:.4f}, val loss {val_loss:.4f}, "
                      f"val acc {val_acc:.4f}, {outer_log[-1]['wire_bytes']} wire bytes, {reduce_seconds:.3f} s")
    if rank == 0:
        result = {key: getattr(args, key) for key in ("codec", "bits", "outer_steps", "inner_steps", "inner_lr",
                                                       "outer_lr", "outer_momentum", "batch_size", "seed",
                                                       "d_model", "layers", "context")}
        result.update(world_size=world, parameters=sum(p.numel() for p in params), outer=outer_log, eval=evals,
                      final_val_loss=evals[-1]["val_loss"], final_val_accuracy=evals[-1]["val_accuracy"],
                      wire_bytes_per_outer_step=sum(o["wire_bytes"] for o in outer_log) / len(outer_log),
                      seconds=loop_seconds, codec_reported=outer_log[-1]["codec"], bits_reported=outer_log[-1]["bits"])
        if args.result_file:
            with open(args.result_file, "w") as f:
                json.dump(result, f)
    pg.close()
    train.leave_together(rank, world)


def launch(args):
    if args.rate:
        script = os.path.join(REPO, "scripts", "bench-diloco-network")
        forwarded = [f"--rate={args.rate}", f"--ranks={args.nodes}", f"--codecs={args.codec}-{args.bits:g}",
                     f"--seeds={args.seed}", f"--outer-steps={args.outer_steps}", f"--inner-steps={args.inner_steps}"]
        os.execv(script, [script, *forwarded])
    world = args.nodes * args.workers_per_node
    tmp = tempfile.mkdtemp(prefix="dynamiq-diloco-")
    daemons, procs = None, []
    try:
        daemons = train.LocalDaemons(train.find_dynamiqd(args.dynamiqd), args.nodes, tmp, args.codec, args.bits,
                                     "ring", 0, args.dynamiqd_arg)
        result_file = os.path.join(tmp, "result.json")
        env = dict(os.environ)
        package = os.path.join(REPO, "build", "python")
        if "PYTHONPATH" not in env and os.path.isdir(package):
            env["PYTHONPATH"] = package
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
        env.setdefault("OMP_NUM_THREADS", str(args.threads))
        forwarded = [a for a in sys.argv[1:] if a != "--json" and not a.startswith("--dynamiqd-arg")]
        for rank in range(world):
            node, local = divmod(rank, args.workers_per_node)
            worker_env = dict(env, RANK=str(rank), WORLD_SIZE=str(world), DQ_SOCKET=daemons.sockets[node],
                              DQ_JOB=f"diloco-{os.getpid()}", DQ_LOCAL_RANK=str(local),
                              DQ_LOCAL_WORLD_SIZE=str(args.workers_per_node))
            cmd = [sys.executable, os.path.abspath(__file__), *forwarded, "--worker",
                   f"--init-method=file://{tmp}/pg-store"]
            if rank == 0:
                cmd.append(f"--result-file={result_file}")
            procs.append(subprocess.Popen(cmd, env=worker_env, stdout=sys.stderr))
        deadline = time.monotonic() + args.timeout
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                for path in daemons.logs:
                    train.log(f"--- {path}\n{train.tail(path)}")
                raise SystemExit("diloco.py: a worker failed or the run timed out")
            time.sleep(0.05)
        if any(p.returncode != 0 for p in procs):
            raise SystemExit("diloco.py: a worker failed")
        with open(result_file) as f:
            result = json.load(f)
        print(json.dumps(result) if args.json else
              f"codec={args.codec} bits={args.bits:g} world={world}: final val loss {result['final_val_loss']:.4f}, "
              f"val accuracy {result['final_val_accuracy']:.4f}, {result['wire_bytes_per_outer_step']:.0f} wire "
              f"bytes per outer step, {result['seconds']:.1f} s")
    finally:
        train.stop_run(procs, daemons, tmp)


def main():
    args = parse_args()
    train.require_torch()
    if args.worker:
        run_worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
