#!/usr/bin/python3
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
split of 1437 train / 360 test), an MLP 64-H-H-10 (H = --hidden) trained with SGD + momentum.

Task `lm`: a byte-level causal transformer language model (--layers pre-norm layers of width
--d-model, 4 heads, FFN 4 x d, context --context) trained with AdamW on the license texts of
Debian's base-files (/usr/share/common-licenses, 14 files, 237 KB; fallback: the Python standard
library sources under /usr/lib/python3*/). Fixed split: the first 90% of every file trains, the
last 10% is the validation ("test") set, evaluated on 128 evenly spaced non-overlapping windows
(8192 predictions); accuracy is next-byte top-1 accuracy; the JSON also has the validation perplexity.

DropCompute (--micro-batches K, --drop-compute auto|SECONDS, --straggle SPEC): each worker's share
of the batch runs as K micro-batches through dynamiq.torch.DropCompute (gradient accumulation
under DDP's no_sync, then one all-reduce weighted by the micro-batches each worker completed),
stopping at a compute deadline: fixed seconds, or `auto` (chosen from every worker's recorded
micro-batch times by the paper's rule after --drop-window steps). --straggle injects stragglers by
sleeping inside each micro-batch's forward: log-normal noise around a base time, and one worker
FACTOR times slower on a share of the steps:

    examples/train.py --task lm --nodes 2 --workers-per-node 2 --codec none --micro-batches 4 \
        --drop-compute auto --straggle base=0.02,sigma=0.5,factor=3,prob=0.1

JSON fields: the configuration, per-step `loss` and `train_accuracy` (averaged over all workers'
shares of the global batch), `eval` (test loss/accuracy every --eval-every steps and at the end, with
rank 0's training seconds so far, evaluations left out),
`final_test_accuracy`, `final_test_loss` (lm: also `final_test_perplexity`), `parameters`,
`steps_per_second` (rank 0's training-step time, without
evaluation and the first --timing-skip steps), `wire_bytes_per_step` (bytes node 0 sent to other
nodes, reported by the daemon), `bits_per_step` (what the daemon ran; under an error budget its
controller's choice) and, with --record-error, per-step `vnmse` of the daemon's result against an
exact all-reduce of the same gradients. With --micro-batches or --drop-compute also `weight_sum`
(per step, the micro-batches completed by all workers), `computed` (per step, per rank),
`dropped_fraction`, `thresholds` (per step, the deadline in force; null: none),
`selection` (the automatic choice), `step_seconds` (rank 0's, per step),
`steps_per_second_after_calibration` and `calibration_steps`.
"""

import argparse
import json
import math
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
    p.add_argument("--task", default="digits", choices=["digits", "lm"],
                   help="what to train: digits (MLP on sklearn's digits) or lm (byte-level transformer on "
                        "/usr/share/common-licenses) (default digits)")
    p.add_argument("--comm", default="dynamiq", choices=["dynamiq", "backend", "gloo"],
                   help="gradient all-reduce: dynamiq (DDP hook through dynamiqd), backend (no hook: the "
                        "torch.distributed backend \"dynamiq\", DDP's own all-reduce through dynamiqd) or gloo "
                        "(torch DDP's own)")
    p.add_argument("--nodes", type=int, default=1, help="launcher: nodes, one dynamiqd each (default 1)")
    p.add_argument("--workers-per-node", type=int, default=2, help="launcher: worker processes per node (default 2)")
    p.add_argument("--codec", default="dynamiq",
                   help="dynamiq codec: none, bf16, dynamiq, mxfp8, mxfp6, mxfp4, thc, uniform, int8, global_qsgd, "
                        "arc_topk, flash (default dynamiq)")
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
    p.add_argument("--batch-size", type=int, default=None,
                   help="global batch size (lm: sequences), split evenly across workers (default: digits 128, lm 16)")
    p.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: digits 0.05 for SGD, lm 0.003 for AdamW)")
    p.add_argument("--momentum", type=float, default=0.9, help="digits: SGD momentum (default 0.9)")
    p.add_argument("--hidden", type=int, default=256, help="digits: MLP hidden width (default 256)")
    p.add_argument("--d-model", type=int, default=64, help="lm: transformer width (default 64)")
    p.add_argument("--layers", type=int, default=2, help="lm: transformer layers (default 2)")
    p.add_argument("--context", type=int, default=64, help="lm: context length in bytes (default 64)")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP bucket size cap in MB (default 25)")
    p.add_argument("--eval-every", type=int, default=50, help="test-set evaluation period in steps (default 50)")
    p.add_argument("--log-every", type=int, default=10, help="progress line period in steps (default 10)")
    p.add_argument("--timing-skip", type=int, default=5,
                   help="first steps left out of steps_per_second (DDP bucket rebuild, connections)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per worker (default 1)")
    p.add_argument("--micro-batches", type=int, default=1,
                   help="micro-batches per worker and step (gradient accumulation through dynamiq.torch.DropCompute; "
                        "default 1: one forward/backward through DDP's hook)")
    p.add_argument("--drop-compute", default=None, metavar="auto|SECONDS",
                   help="DropCompute: stop a worker's micro-batches at this compute deadline per step (seconds), or "
                        "auto: chosen from all workers' recorded micro-batch times (default off)")
    p.add_argument("--drop-window", type=int, default=20,
                   help="--drop-compute auto: steps recorded (without a deadline) before choosing (default 20)")
    p.add_argument("--drop-max", type=float, default=None, metavar="FRACTION",
                   help="--drop-compute auto: the most micro-batches the threshold may drop on the recorded times "
                        "(default: the paper's rule alone)")
    p.add_argument("--straggle", default=None, metavar="SPEC",
                   help="inject stragglers by sleeping in each micro-batch's forward: comma-separated base=SECONDS "
                        "(mean injected time per micro-batch), sigma=S (log-normal noise around it), factor=F and "
                        "prob=P (one worker F times slower on a share P of the steps), rank=R (that worker; default "
                        "the last)")
    p.add_argument("--lossy-phase-ms", type=float, default=0,
                   help="the loss-tolerant all-reduce (docs/design.md): dynamiqd --transport=udp, each of its two "
                        "phases ending this many ms after the node's sends with what arrived; codec none "
                        "or bf16 (default 0: reliable)")
    p.add_argument("--resync-every", type=int, default=0,
                   help="every N steps, make the model's parameters identical on every worker (sync_state: exact, "
                        "so reliable); bounds the drift the loss-tolerant all-reduce leaves (default 0: never)")
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
    if args.batch_size is None:
        args.batch_size = 128 if args.task == "digits" else 16
    if args.lr is None:
        args.lr = 0.05 if args.task == "digits" else 0.003
    if args.d_model < 4 or args.d_model % 4 or args.layers < 1 or args.context < 2:
        p.error("--d-model must be a positive multiple of 4 (4 heads), --layers >= 1, --context >= 2")
    if args.record_error and args.comm != "dynamiq":
        p.error("--record-error measures dynamiq's error: it needs --comm dynamiq")
    if args.comm == "backend" and (args.control or args.warmup_steps):
        p.error("--comm backend runs the daemons' own configuration: no --control, no --warmup-steps")
    if args.micro_batches < 1:
        p.error("--micro-batches must be at least 1")
    if args.drop_compute is not None and args.drop_compute != "auto":
        try:
            if float(args.drop_compute) < 0:
                raise ValueError
        except ValueError:
            p.error(f"--drop-compute takes auto or seconds >= 0, not {args.drop_compute!r}")
    try:
        args.straggle_config = parse_straggle(args.straggle)
    except ValueError as e:
        p.error(str(e))
    return args


STRAGGLE_KEYS = {"base": 0.0, "sigma": 0.0, "factor": 1.0, "prob": 0.0, "rank": -1}


def parse_straggle(spec):
    """--straggle "base=0.02,sigma=0.5,factor=3,prob=0.1" as a dict (STRAGGLE_KEYS' defaults), or None."""
    if not spec:
        return None
    config = dict(STRAGGLE_KEYS)
    for item in spec.split(","):
        key, _, value = item.partition("=")
        if key not in STRAGGLE_KEYS or not value:
            raise ValueError(f"--straggle: {item!r} is not KEY=VALUE with KEY one of {', '.join(STRAGGLE_KEYS)}")
        try:
            config[key] = int(value) if key == "rank" else float(value)
        except ValueError:
            raise ValueError(f"--straggle: {key} takes a number, not {value!r}") from None
    if config["base"] < 0 or config["sigma"] < 0 or config["factor"] < 1 or not 0 <= config["prob"] <= 1:
        raise ValueError("--straggle: base and sigma must be >= 0, factor >= 1, prob in [0, 1]")
    return config


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


# Task lm: the corpus, a fixed file list (base-files ships it on every Debian system), in this order.
LICENSE_DIR = "/usr/share/common-licenses"
LICENSE_FILES = ("Apache-2.0", "Artistic", "BSD", "CC0-1.0", "GFDL-1.2", "GFDL-1.3", "GPL-1", "GPL-2", "GPL-3",
                 "LGPL-2", "LGPL-2.1", "LGPL-3", "MPL-1.1", "MPL-2.0")
VALIDATION_SHARE = 0.1
VALIDATION_WINDOWS = 128


def load_text():
    """(train bytes, validation bytes, corpus name): per file, the first 90% trains and the last 10%
    validates, so both sets sample every file and the split never depends on --seed."""
    import glob
    import numpy as np
    paths = [os.path.join(LICENSE_DIR, f) for f in LICENSE_FILES]
    name = LICENSE_DIR
    if not all(os.path.isfile(f) for f in paths):
        paths, name = sorted(glob.glob("/usr/lib/python3*/*.py")), "/usr/lib/python3*/*.py"
        if not paths:
            raise SystemExit(f"task lm needs {LICENSE_DIR} (base-files) or Python sources under /usr/lib/python3*/")
    train, valid = [], []
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        cut = len(data) - int(len(data) * VALIDATION_SHARE)
        train.append(data[:cut])
        valid.append(data[cut:])
    def as_array(parts):
        return np.frombuffer(b"".join(parts), dtype=np.uint8).astype(np.int64)

    return as_array(train), as_array(valid), name


def make_lm(args, vocab=256):
    """Byte-level causal transformer: embeddings + learned positions, pre-norm layers, linear head."""
    import torch
    torch.manual_seed(args.seed)

    class CausalLM(torch.nn.Module):
        def __init__(self, d, layers, context):
            super().__init__()
            self.tok = torch.nn.Embedding(vocab, d)
            self.pos = torch.nn.Parameter(torch.zeros(context, d))
            torch.nn.init.normal_(self.pos, std=0.02)
            layer = torch.nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True,
                                                     activation="gelu")
            self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(d)
            self.head = torch.nn.Linear(d, vocab)
            self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1))

        def forward(self, x):
            n = x.shape[1]
            h = self.tok(x) + self.pos[:n]
            return self.head(self.norm(self.blocks(h, mask=self.mask[:n, :n])))

    return CausalLM(args.d_model, args.layers, args.context)


class DigitsTask:
    """MLP on sklearn's digits; SGD with momentum."""

    def __init__(self, args, rank, share):
        self.x_train, self.y_train, self.x_test, self.y_test = load_digits()
        self.model = make_model(args)
        self.args, self.rank, self.share = args, rank, share
        self.batches = global_batches(len(self.y_train), args.batch_size, args.seed)

    def optimizer(self, params):
        import torch
        return torch.optim.SGD(params, lr=self.args.lr, momentum=self.args.momentum)

    def next_batch(self):
        idx = next(self.batches)[self.rank * self.share:(self.rank + 1) * self.share]
        return self.x_train[idx], self.y_train[idx]

    @staticmethod
    def loss_accuracy(output, y):
        import torch
        loss = torch.nn.functional.cross_entropy(output, y)
        return loss, (output.argmax(1) == y).float().mean().item()

    def evaluate(self, model):
        return evaluate(model, self.x_test, self.y_test)


class LmTask:
    """Byte-level transformer LM; AdamW. A global batch is --batch-size windows of --context + 1
    bytes at seeded random offsets of the training text; each worker takes its share."""

    def __init__(self, args, rank, share):
        import numpy as np
        import torch
        train, valid, self.corpus = load_text()
        self.train = torch.from_numpy(train)
        n = args.context + 1
        windows = (len(valid) - 1) // args.context  # non-overlapping inputs, each with its next byte
        if windows < 1:
            raise SystemExit("task lm: validation text shorter than one context")
        # At most VALIDATION_WINDOWS of them, evenly spaced (evaluation runs on rank 0 alone).
        starts = np.unique(np.linspace(0, windows - 1, min(windows, VALIDATION_WINDOWS)).round().astype(np.int64))
        starts = starts * args.context
        self.valid = torch.from_numpy(valid[starts[:, None] + np.arange(n)])
        self.model = make_lm(args)
        self.args, self.rank, self.share = args, rank, share
        self.rng = np.random.default_rng([args.seed, 1])
        self.offsets = np.arange(n)

    def optimizer(self, params):
        import torch
        return torch.optim.AdamW(params, lr=self.args.lr, weight_decay=0.01)

    def next_batch(self):
        import torch
        starts = self.rng.integers(0, len(self.train) - self.args.context - 1, size=self.args.batch_size)
        mine = starts[self.rank * self.share:(self.rank + 1) * self.share]
        seq = self.train[torch.from_numpy(mine[:, None] + self.offsets)]
        return seq[:, :-1], seq[:, 1:]

    @staticmethod
    def loss_accuracy(output, y):
        import torch
        logits = output.reshape(-1, output.shape[-1])
        target = y.reshape(-1)
        loss = torch.nn.functional.cross_entropy(logits, target)
        return loss, (logits.argmax(1) == target).float().mean().item()

    def evaluate(self, model, chunk=128):
        import torch
        total_loss, correct, count = 0.0, 0, 0
        with torch.no_grad():
            for i in range(0, len(self.valid), chunk):
                seq = self.valid[i:i + chunk]
                logits = model(seq[:, :-1]).reshape(-1, 256)
                target = seq[:, 1:].reshape(-1)
                total_loss += torch.nn.functional.cross_entropy(logits, target, reduction="sum").item()
                correct += (logits.argmax(1) == target).sum().item()
                count += target.numel()
        return total_loss / count, correct / count


TASKS = {"digits": DigitsTask, "lm": LmTask}


class Straggler:
    """Injected compute time, slept (not burnt: the machine's cores stay with the real work) in each
    micro-batch's forward: base * exp(sigma * Z - sigma^2 / 2) (log-normal with mean `base`, the
    per-micro-batch noise of DropCompute's paper), times `factor` on the straggler rank in a share
    `prob` of the steps (the same steps on every worker: seeded by --seed only). The straggler's
    real compute is not slowed: its injected time is."""

    def __init__(self, config, rank, world, seed):
        import numpy as np
        self.config = config
        self.slow_rank = config["rank"] % world
        self.is_slow_rank = rank == self.slow_rank
        self.noise = np.random.default_rng([seed, rank, 38])
        self.slow_steps = np.random.default_rng([seed, 38])

    def step(self):
        """Starts a step; returns whether the straggler is slow in it."""
        self.slow = bool(self.slow_steps.random() < self.config["prob"])
        return self.slow

    def sleep(self):
        import numpy as np
        c = self.config
        seconds = c["base"] * float(np.exp(c["sigma"] * self.noise.standard_normal() - c["sigma"] ** 2 / 2))
        if self.slow and self.is_slow_rank:
            seconds *= c["factor"]
        if seconds > 0:
            time.sleep(seconds)


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
    pg = None
    if args.comm == "backend":
        import dynamiq.torch  # registers the backend
        dist.init_process_group("dynamiq", init_method=args.init_method, rank=rank, world_size=world)
        pg = dynamiq.torch.get_process_group()
    else:
        dist.init_process_group("gloo", init_method=args.init_method, rank=rank, world_size=world)

    share = args.batch_size // world
    task = TASKS[args.task](args, rank, share)
    model = task.model
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    state = None
    if args.comm == "dynamiq":
        import dynamiq.torch
        codec_options = {}
        if args.control:  # the launcher did not start the daemons with these options
            codec_options = dict(codec=args.codec, bits=args.bits, topology=args.topology,
                                 min_compress_elements=args.min_compress_elements, control=args.control,
                                 lossy_phase_ms=args.lossy_phase_ms)
        state = dynamiq.torch.DynamiqState(warmup_steps=args.warmup_steps, record_error=args.record_error,
                                           **codec_options)
        ddp.register_comm_hook(state, dynamiq.torch.allreduce_hook)
        if rank == 0:
            c = state.client.config
            log(f"dynamiq job {state.client.job}: node {state.client.node_rank}/{state.client.num_nodes}, "
                f"codec at registration {c.codec} bits {c.bits:g} min_compress {c.min_compress_elements}")
    optimizer = task.optimizer(ddp.parameters())
    accumulate = args.micro_batches > 1 or args.drop_compute is not None or args.straggle_config is not None
    if accumulate:
        import dynamiq.torch
        if share % args.micro_batches:
            raise SystemExit(f"--micro-batches {args.micro_batches} does not divide the {share} samples per worker")
        threshold = args.drop_compute if args.drop_compute in (None, "auto") else float(args.drop_compute)
        drop = dynamiq.torch.DropCompute(ddp, args.micro_batches, threshold, state=state,
                                         window=args.drop_window, max_dropped=args.drop_max)
        straggler = Straggler(args.straggle_config or STRAGGLE_KEYS, rank, world, args.seed)
    # Per step: this worker's completed micro-batches and the sums of their losses and accuracies
    # (the step's loss is the mean over every worker's completed micro-batches); the global weights.
    computed, weight_sums, thresholds, calibrating = [], [], [], []

    losses, accuracies, evals, step_seconds, resyncs = [], [], [], [], []
    if args.resync_every > 0:
        import dynamiq.torch
    for step in range(args.steps):
        xb, yb = task.next_batch()
        started = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        if accumulate:
            xs, ys = xb.chunk(args.micro_batches), yb.chunk(args.micro_batches)
            outcomes = []
            straggler.step()

            def forward(m):
                loss, accuracy = task.loss_accuracy(ddp(xs[m]), ys[m])
                outcomes.append((loss.item(), accuracy))
                straggler.sleep()
                return loss

            result = drop.step(forward)
            done = outcomes[:result.computed]
            losses.append(sum(o[0] for o in done))  # sums: averaged over all workers below
            accuracies.append(sum(o[1] for o in done))
            computed.append(result.computed)
            weight_sums.append(result.weight_sum)
            thresholds.append(result.threshold)
            calibrating.append(result.calibrating)
        else:
            loss, accuracy = task.loss_accuracy(ddp(xb), yb)
            loss.backward()
            losses.append(loss.item())
            accuracies.append(accuracy)
        optimizer.step()
        if args.resync_every > 0 and (step + 1) % args.resync_every == 0:
            # How far the workers' models drifted apart since the last resync (a measurement over
            # torch.distributed's own group, exact): the largest ||w - mean|| / ||mean||.
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            mean = flat.clone()
            dist.all_reduce(mean)
            mean /= world
            spread = torch.tensor([float((flat - mean).norm() / mean.norm().clamp_min(1e-30))])
            dist.all_reduce(spread, op=dist.ReduceOp.MAX)
            # The reliable resync: the parameters most workers hold go to those that drifted.
            synced = dynamiq.torch.sync_state(dict(model.named_parameters()), rank=rank, world=world, name="resync",
                                              client=state.client if state is not None else None)
            resyncs.append({"step": step + 1, "copied": bool(synced["copied"]), "agreeing": synced["agreeing"],
                            "spread": float(spread[0])})
        step_seconds.append(time.perf_counter() - started)
        if rank == 0 and (step + 1) % args.log_every == 0:
            if accumulate:
                total = result.weight_sum if result.weight_sum is not None else float("nan")
                planned = world * args.micro_batches
                deadline = "none" if result.threshold is None else f"{result.threshold:.3f} s"
                log(f"step {step + 1}/{args.steps} loss {losses[-1] / max(result.computed, 1):.4f} weight "
                    f"{result.computed}/{args.micro_batches}, all {total:g}/{planned} (dropped {planned - total:g}) "
                    f"threshold {deadline}{' calibrating' if result.calibrating else ''} "
                    f"({1.0 / max(step_seconds[-1], 1e-9):.1f} steps/s)")
            else:
                log(f"step {step + 1}/{args.steps} loss {losses[-1]:.4f} batch accuracy {accuracies[-1]:.3f} "
                    f"({1.0 / max(step_seconds[-1], 1e-9):.1f} steps/s)")
        if rank == 0 and ((step + 1) % args.eval_every == 0 or step + 1 == args.steps):
            test_loss, test_accuracy = task.evaluate(model)
            # train_seconds: rank 0's training time so far, evaluations left out (time to a target).
            evals.append({"step": step + 1, "test_loss": test_loss, "test_accuracy": test_accuracy,
                          "train_seconds": sum(step_seconds)})
            log(f"step {step + 1}: test loss {test_loss:.4f} test accuracy {test_accuracy:.4f}")

    # Per-step values of every worker, averaged on rank 0 (one collective, after the timing).
    gathered = [None] * world
    dist.all_gather_object(gathered, (losses, accuracies, computed))
    result = None
    if rank == 0:
        timed = step_seconds[args.timing_skip:] or step_seconds
        if accumulate:
            # Means over every worker's completed micro-batches (a step where none completed: nan).
            counts = [sum(g[2][s] for g in gathered) for s in range(args.steps)]
            mean_loss = [sum(g[0][s] for g in gathered) / counts[s] if counts[s] else math.nan
                         for s in range(args.steps)]
            mean_accuracy = [sum(g[1][s] for g in gathered) / counts[s] if counts[s] else math.nan
                             for s in range(args.steps)]
        else:
            mean_loss = [sum(g[0][s] for g in gathered) / world for s in range(args.steps)]
            mean_accuracy = [sum(g[1][s] for g in gathered) / world for s in range(args.steps)]
        result = {
            "task": args.task, "comm": args.comm, "world_size": world, "steps": args.steps, "seed": args.seed,
            "batch_size": args.batch_size, "lr": args.lr, "warmup_steps": args.warmup_steps,
            "parameters": sum(p.numel() for p in model.parameters()),
            "loss": mean_loss,
            "train_accuracy": mean_accuracy,
            "eval": evals,
            "final_test_loss": evals[-1]["test_loss"],
            "final_test_accuracy": evals[-1]["test_accuracy"],
            "steps_per_second": len(timed) / sum(timed),
            "bucket_cap_mb": args.bucket_cap_mb,
            "train_seconds": sum(step_seconds),
            "lossy_phase_ms": args.lossy_phase_ms,
            "resyncs": resyncs,
        }
        if accumulate:
            planned = args.steps * world * args.micro_batches
            last_calibration = max([s for s, c in enumerate(calibrating) if c], default=-1)
            after = step_seconds[last_calibration + 1:] if last_calibration >= 0 else timed
            result.update(micro_batches=args.micro_batches, drop_compute=args.drop_compute, straggle=args.straggle,
                          computed=[[g[2][s] for g in gathered] for s in range(args.steps)],
                          weight_sum=weight_sums, thresholds=thresholds, calibration_steps=sum(calibrating),
                          dropped_fraction=1 - sum(counts) / planned, selection=drop.selection,
                          step_seconds=step_seconds,
                          steps_per_second_after_calibration=len(after) / sum(after) if after else None)
        if args.task == "digits":
            result.update(optimizer="sgd", momentum=args.momentum, hidden=args.hidden)
        else:
            result.update(optimizer="adamw", d_model=args.d_model, layers=args.layers, context=args.context,
                          corpus=task.corpus, final_test_perplexity=math.exp(result["final_test_loss"]))
        if state is not None:
            summaries = [state.step_summary(s) for s in range(args.warmup_steps, args.steps)]
            # What the daemon reported running (bits 0 on the command line means the codec's default).
            result["codec_reported"] = sorted({r["codec"] for r in state.records})
            result["bits_reported"] = sorted({r["bits"] for r in state.records})
            result["wire_bytes_per_step"] = (sum(s["wire_bytes"] for s in summaries) / len(summaries)
                                             if summaries else 0.0)
            # Per step, the bits the daemon reported (under an error budget: the controller's choice).
            result["bits_per_step"] = [s["bits"] for s in summaries]
            if args.record_error:
                result["vnmse"] = [s.get("vnmse") for s in summaries]
            # Per step, the error dynamiqd itself measured (its error probe; None where it sampled
            # nothing: --dynamiqd-arg=--error_sample_rate=1 samples every compressed collective).
            if any("daemon_vnmse" in s for s in summaries):
                result["daemon_vnmse"] = [s.get("daemon_vnmse") for s in summaries]
        if pg is not None:  # DDP's buckets reached the daemon as the backend's all-reduces
            records = list(pg.records)
            result["codec_reported"] = sorted({r["codec"] for r in records})
            result["bits_reported"] = sorted({r["bits"] for r in records})
            result["wire_bytes_per_step"] = sum(r["wire_bytes"] for r in records) / args.steps
    if state is not None:
        state.close()
    if rank == 0:
        if args.result_file:
            tmp = args.result_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(result, f)
            os.replace(tmp, args.result_file)
        else:
            print(json.dumps(result) if args.json else summarize(result))
    leave_together(rank, world)


def leave_together(rank, world, timeout=120):
    """Ends the worker once every rank is past its last collective, without tearing down the
    process group. torch 1.13 (Gloo): freeing DDP's reducer and the group blocks forever on one rank
    in about one run in three; and a rank that exits while a peer still reads its last Gloo message
    resets that connection (a barrier before exiting only moves the race). So the ranks meet on the
    rendezvous store instead, rank 0 (which may host the store) last, and leave with os._exit."""
    import torch.distributed.distributed_c10d as c10d
    store = c10d._get_default_store()
    deadline = time.monotonic() + timeout

    def wait_for(key, count):
        while store.add(key, 0) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"rank {rank}: the other ranks did not finish within {timeout} s")
            time.sleep(0.01)

    store.add("train.done", 1)
    wait_for("train.done", world)  # every rank has returned from every collective
    if rank == 0:
        wait_for("train.left", world - 1)  # ... and the others are done with the store
    else:
        store.add("train.left", 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    if result["comm"] in ("dynamiq", "backend") and result.get("nodes") == 1:
        lines.append("  one node: workers are summed exactly in shared memory (the codec runs between nodes)")
    if "micro_batches" in result:
        selection = result.get("selection") or {}
        chosen = selection.get("threshold", "none") if selection else result.get("drop_compute") or "none"
        lines.append(f"  {result['micro_batches']} micro-batches per worker, threshold {chosen}, "
                     f"{100 * result['dropped_fraction']:.1f}% dropped, "
                     f"{result['steps_per_second_after_calibration'] or 0:.2f} steps/s after calibration")
    if "wire_bytes_per_step" in result:
        lines.append(f"  {result['wire_bytes_per_step']:.0f} bytes/step sent by node 0 to other nodes")
    if result.get("vnmse"):
        v = [x for x in result["vnmse"] if x is not None]
        if v:
            lines.append(f"  vNMSE per step: mean {sum(v) / len(v):.3g}, max {max(v):.3g}")
    return "\n".join(lines)


# The flags a worker takes from the launcher's command line.
WORKER_FLAGS = ("task", "comm", "codec", "bits", "topology", "min_compress_elements", "warmup_steps", "steps", "seed",
                "batch_size", "lr", "momentum", "hidden", "d_model", "layers", "context", "bucket_cap_mb", "eval_every",
                "log_every", "timing_skip", "threads", "micro_batches", "drop_compute", "drop_window", "drop_max",
                "straggle", "lossy_phase_ms", "resync_every")


def worker_flags(args):
    flags = [f"--{name.replace('_', '-')}={getattr(args, name)}" for name in WORKER_FLAGS
             if getattr(args, name) is not None]
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
        if args.comm in ("dynamiq", "backend"):
            if args.sockets:
                sockets = args.sockets.split(",")
                if len(sockets) != args.nodes:
                    raise SystemExit(f"--sockets names {len(sockets)} sockets for {args.nodes} nodes")
            else:
                extra = list(args.dynamiqd_arg)
                if args.lossy_phase_ms > 0:
                    extra += ["--transport=udp", f"--lossy_phase_ms={args.lossy_phase_ms:g}"]
                daemons = LocalDaemons(find_dynamiqd(args.dynamiqd), args.nodes, tmp, args.codec, args.bits,
                                       args.topology, args.min_compress_elements, extra)
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
            if args.comm in ("dynamiq", "backend"):
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
        if args.comm in ("dynamiq", "backend") and (daemons is not None or control):
            reported = result["bits_reported"] or [args.bits]
            result.update(codec=args.codec, bits=args.bits or reported[0], topology=args.topology,
                          min_compress_elements=args.min_compress_elements)
        elif args.comm in ("dynamiq", "backend"):  # running daemons with their own job defaults
            result.update(codec=",".join(result["codec_reported"]), bits=(result["bits_reported"] or [None])[0])
        result["record_error"] = args.record_error
        print(json.dumps(result) if args.json else summarize(result))
    finally:
        stop_run(procs, daemons, tmp)


def stop_run(procs, daemons, tmp):
    """Kills the worker processes still running, stops the daemons (if any) and removes `tmp`."""
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    if daemons is not None:
        daemons.close()
    shutil.rmtree(tmp, ignore_errors=True)


def require_torch():
    """Exits with a clear message when this interpreter has no PyTorch (a python3 earlier in PATH
    than Debian's, say), naming the one that has it."""
    try:
        import torch  # noqa: F401
    except ImportError:
        debian = "/usr/bin/python3"
        hint = (f"run it with Debian's {debian}: {debian} {' '.join(sys.argv)}"
                if os.path.exists(debian) and os.path.realpath(sys.executable) != os.path.realpath(debian)
                else "install Debian's python3-torch (apt-get install python3-torch)")
        sys.exit(f"examples/train.py needs PyTorch, which {sys.executable} does not have; {hint}")


def main():
    args = parse_args()
    require_torch()
    if args.worker:
        run_worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
