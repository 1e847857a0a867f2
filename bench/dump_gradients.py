#!/usr/bin/python3
"""Dump real per-rank gradient buckets of a small data-parallel training run, for dynamiq-bench codec.

Trains one model with torch DistributedDataParallel on --workers local processes (Gloo over
loopback, one thread each) and, at the --dump-steps, writes every rank's flattened gradient
bucket exactly as DDP hands it to a communication hook (bucket.buffer(): the parameters of the
bucket concatenated in DDP's order, the rank's local gradient, not yet averaged) to a raw
little-endian float32 file:

    OUT/<model>_w<workers>_s<step>_b<bucket>_r<rank>.bin

plus OUT/<model>_w<workers>.json, a manifest with the parameter names, shapes and offsets of every
bucket at every dumped step, the training loss, and the dynamiq-bench command for each dump:

    bench/dump_gradients.py --model mlp --workers 2 --out /tmp/grads
    build/bin/dynamiq-bench codec --workers=2 --codec=all --bits=5 \\
        --input=/tmp/grads/mlp_w2_s300_b0_r0.bin,/tmp/grads/mlp_w2_s300_b0_r1.bin

--align MANIFEST rewrites existing dumps in the super-group aligned layout (every tensor of >= 4096
elements or of a multiple of 256 starts on a 256-element boundary; the rest packed at the end) and
prints the dynamiq-bench command at the same wire bits per original coordinate:

    bench/dump_gradients.py --align /tmp/grads/mlp_w2.json

The global batch (--batch-size) is split evenly across the workers as in examples/train.py, so
runs with different --workers follow the same data order and model trajectory (up to float
summation order). Step 1 uses DDP's initial buckets (parameters in registration order); after it
DDP rebuilds them in gradient-ready order (roughly reversed), which moves every tensor's offset:
DynamiQ's error depends on where tensors fall relative to its 256-element super-groups
(docs/codec_real_gradients.md).

Models (all small enough for a laptop CPU):
  mlp  examples/train.py's digits task: MLP 64-256-256-10 (85,002 parameters, one DDP bucket),
       SGD lr 0.05 momentum 0.9, global batch 128.
  cnn  digits as 1x8x8 images: conv3x3(32)-conv3x3(64)-maxpool-fc(256)-fc(10) (283,786 parameters;
       one bucket at step 1, two after the rebuild), SGD lr 0.05 momentum 0.9, global batch 128.
  testmlp  tests/python/ddp_worker.py's model and data: MLP 64-128-64-10 (17,226 parameters) at
       its initialisation (no optimizer step), random N(0,1) inputs and labels, 16 samples per rank
       (global batch 16 x workers), DDP's bucket limits of that test (first bucket 20000 bytes, cap
       0.02 MB): one 17,226-element bucket at step 1, then 8,906 + 8,320. Use --steps 3: the
       gradients test_hook_with_dynamiq_5_bits_stays_within_its_error compresses.
  lm   byte-level causal transformer LM on the Python standard library sources found on this
       machine (/usr/lib/python3*/*.py): d_model 128, 2 pre-norm layers, 4 heads, FFN 512,
       context 64 (470,784 parameters; one bucket at step 1, two after the rebuild), AdamW lr 1e-3,
       global batch 32 sequences.
  lm4  the same LM, 4 layers (d_model 128, FFN 512, context 64; 867,328 parameters, 9% in embeddings and head),
       AdamW lr 1e-3, global batch 32 sequences.
  lmemb  a wider 4-layer LM (d_model 160, FFN 640, context 64) whose input adds a hashed byte-bigram
       embedding of 8192 rows to the byte embedding (2,640,576 parameters, 53% in embeddings and head): like a
       large-vocabulary LLM, each step touches a few hundred of the 8192 rows, so most embedding rows
       have an all-zero gradient on a rank and rare ones are non-zero on one rank only. AdamW lr 1e-3,
       global batch 32 sequences.
bench/make_corpus.sh builds the codec corpus of docs/codec_real_gradients.md from these models.
Needs /usr/bin/python3 with torch (Debian python3-torch) and, for mlp/cnn, python3-sklearn.
"""

import argparse
import glob
import json
import os
import socket
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "lm", "lm4", "lmemb", "testmlp"],
                   help="what to train (default mlp)")
    p.add_argument("--workers", type=int, default=2, help="data-parallel ranks, one process each (default 2)")
    p.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    p.add_argument("--dump-steps", default="1,100,300",
                   help="comma-separated 1-based steps whose gradients are written (default 1,100,300)")
    p.add_argument("--batch-size", type=int, default=0,
                   help="global batch, split evenly across workers (default: 128 for mlp/cnn, 32 for lm, "
                        "16 x workers for testmlp)")
    p.add_argument("--bucket-cap-mb", type=float, default=25, help="DDP bucket size cap in MB (default 25)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data order (default 0)")
    p.add_argument("--out", help="output directory (created if missing)")
    p.add_argument("--align", metavar="MANIFEST",
                   help="no training: rewrite the dumps of MANIFEST (OUT/<model>_w<workers>.json) in the "
                        "super-group aligned layout of dynamiq.torch's hook (aligned_layout below) as "
                        "..._aligned_r<rank>.bin and print the dynamiq-bench commands at equal wire bits")
    args = p.parse_args(argv)
    if args.align:
        return args
    if not args.out:
        p.error("--out is required (unless --align)")
    args.dump = sorted({int(s) for s in args.dump_steps.split(",") if s.strip()})
    if args.workers < 1 or args.steps < 1:
        p.error("--workers and --steps must be at least 1")
    if not args.dump or args.dump[0] < 1 or args.dump[-1] > args.steps:
        p.error("--dump-steps must lie in 1..--steps")
    if args.batch_size == 0:
        args.batch_size = {"lm": 32, "lm4": 32, "lmemb": 32, "testmlp": 16 * args.workers}.get(args.model, 128)
    if args.batch_size % args.workers != 0:
        p.error(f"--batch-size {args.batch_size} is not divisible by --workers {args.workers}")
    return args


# ---------------------------------------------------------------------------------------------
# Models and data


def load_train_module():
    sys.path.insert(0, os.path.join(REPO, "examples"))
    import train  # examples/train.py: load_digits, make_model, global_batches
    return train


class CausalLM:
    """Factory for the byte-level transformer (built lazily so torch is imported in the workers)."""

    @staticmethod
    def build(vocab=256, d=128, layers=2, heads=4, ffn=512, context=64, bigram_rows=0):
        import torch

        class Model(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.tok = torch.nn.Embedding(vocab, d)
                # Hashed (previous byte, byte) embedding: a large, sparsely updated table.
                self.bigram = torch.nn.Embedding(bigram_rows, d) if bigram_rows else None
                self.pos = torch.nn.Parameter(torch.zeros(context, d))
                torch.nn.init.normal_(self.pos, std=0.02)
                layer = torch.nn.TransformerEncoderLayer(d, heads, ffn, dropout=0.0, batch_first=True,
                                                         norm_first=True, activation="gelu")
                self.blocks = torch.nn.TransformerEncoder(layer, layers)
                self.norm = torch.nn.LayerNorm(d)
                self.head = torch.nn.Linear(d, vocab)
                self.register_buffer("mask", torch.triu(torch.full((context, context), float("-inf")), 1))

            def forward(self, x):
                h = self.tok(x) + self.pos[:x.shape[1]]
                if self.bigram is not None:
                    prev = torch.nn.functional.pad(x[:, :-1], (1, 0))
                    h = h + self.bigram((prev * 257 + x * 31) % bigram_rows)
                h = self.blocks(h, mask=self.mask[:x.shape[1], :x.shape[1]])
                return self.head(self.norm(h))

        return Model()


def text_corpus():
    import numpy as np
    files = sorted(glob.glob("/usr/lib/python3*/*.py"))
    if not files:
        raise SystemExit("model lm needs Python sources under /usr/lib/python3*/ as its text corpus")
    data = b"".join(open(f, "rb").read() for f in files)
    return np.frombuffer(data, dtype=np.uint8)


def make_task(args):
    """Returns (model, optimizer, batch_fn(step, rank) -> loss tensor on the rank's share)."""
    import numpy as np
    import torch
    share = args.batch_size // args.workers
    if args.model == "testmlp":
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                    torch.nn.ReLU(), torch.nn.Linear(64, 10))

        def loss_fn(ddp, rank):
            g = torch.Generator().manual_seed(1000 * (loss_fn.step) + rank)
            loss_fn.step += 1
            x, y = torch.randn(share, 64, generator=g), torch.randint(0, 10, (share,), generator=g)
            return torch.nn.functional.cross_entropy(ddp(x), y)

        loss_fn.step = 0
        return model, dict(kind="sgd", lr=0.0, momentum=0.0), loss_fn
    if args.model in ("mlp", "cnn"):
        train = load_train_module()
        x, y, _, _ = train.load_digits()
        if args.model == "mlp":
            model = train.make_model(argparse.Namespace(seed=args.seed, hidden=256))
        else:
            torch.manual_seed(args.seed)
            x = x.reshape(-1, 1, 8, 8)
            model = torch.nn.Sequential(
                torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(),
                torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Flatten(), torch.nn.Linear(64 * 16, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
        batches = train.global_batches(len(y), args.batch_size, args.seed)

        def loss_fn(ddp, rank):
            idx = next(batches)[rank * share:(rank + 1) * share]
            return torch.nn.functional.cross_entropy(ddp(x[idx]), y[idx])

        return model, dict(kind="sgd", lr=0.05, momentum=0.9), loss_fn
    torch.manual_seed(args.seed)
    model = {"lm": lambda: CausalLM.build(),
             "lm4": lambda: CausalLM.build(layers=4),
             "lmemb": lambda: CausalLM.build(d=160, layers=4, heads=4, ffn=640, bigram_rows=8192)}[args.model]()
    corpus = torch.from_numpy(text_corpus().astype(np.int64))
    context = 64
    rng = np.random.default_rng(args.seed)

    def loss_fn(ddp, rank):
        starts = rng.integers(0, len(corpus) - context - 1, size=args.batch_size)[rank * share:(rank + 1) * share]
        seq = torch.stack([corpus[s:s + context + 1] for s in starts])
        logits = ddp(seq[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), seq[:, 1:].reshape(-1))

    return model, dict(kind="adamw", lr=1e-3), loss_fn


# ---------------------------------------------------------------------------------------------
# Worker


def worker(rank, args, init_method):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=args.workers)
    model, opt_spec, loss_fn = make_task(args)
    names = {id(p): n for n, p in model.named_parameters()}
    bucket_cap_mb = args.bucket_cap_mb
    if args.model == "testmlp":  # as tests/python/ddp_worker.py: torch 1.13 reads this attribute
        dist._DEFAULT_FIRST_BUCKET_BYTES = 20000
        bucket_cap_mb = 0.02
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    state = {"step": 0, "buckets": {}}

    def hook(process_group, bucket):
        if state["step"] in args.dump:
            buf = bucket.buffer().detach().to(torch.float32).contiguous().numpy()
            # bucket.parameters() lists the bucket's tensors in buffer order: check it.
            grads = torch.cat([g.reshape(-1) for g in bucket.gradients()]).to(torch.float32).numpy()
            assert (grads == buf).all(), "bucket.gradients() do not concatenate to bucket.buffer()"
            name = f"{args.model}_w{args.workers}_s{state['step']}_b{bucket.index()}_r{rank}.bin"
            path = os.path.join(args.out, name)
            buf.astype("<f4").tofile(path)
            layout, offset = [], 0
            for p in bucket.parameters():
                layout.append({"name": names.get(id(p), "?"), "shape": list(p.shape), "offset": offset})
                offset += p.numel()
            state["buckets"][(state["step"], bucket.index())] = {"file_rank0": path, "elements": int(buf.size),
                                                                  "parameters": layout}
        return default_hooks.allreduce_hook(process_group, bucket)

    ddp.register_comm_hook(None, hook)
    if opt_spec["kind"] == "sgd":
        opt = torch.optim.SGD(ddp.parameters(), lr=opt_spec["lr"], momentum=opt_spec["momentum"])
    else:
        opt = torch.optim.AdamW(ddp.parameters(), lr=opt_spec["lr"])
    losses = []
    for step in range(1, args.steps + 1):
        state["step"] = step
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp, rank)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if rank == 0 and (step % 50 == 0 or step == 1):
            print(f"{args.model} w{args.workers} step {step}/{args.steps} loss {loss.item():.4f}", file=sys.stderr,
                  flush=True)
    gathered = [None] * args.workers
    dist.all_gather_object(gathered, losses)
    if rank == 0:
        manifest = {"model": args.model, "workers": args.workers, "steps": args.steps, "batch_size": args.batch_size,
                    "seed": args.seed, "parameters": sum(p.numel() for p in model.parameters()),
                    "loss": [sum(g[s] for g in gathered) / args.workers for s in range(args.steps)], "dumps": []}
        for (step, b), info in sorted(state["buckets"].items()):
            files = [os.path.join(args.out, f"{args.model}_w{args.workers}_s{step}_b{b}_r{r}.bin")
                     for r in range(args.workers)]
            manifest["dumps"].append({"step": step, "bucket": b, "elements": info["elements"], "files": files,
                                      "parameters": info["parameters"],
                                      "bench": f"dynamiq-bench codec --workers={args.workers} --codec=all --bits=5 "
                                               f"--input={','.join(files)}"})
        with open(os.path.join(args.out, f"{args.model}_w{args.workers}.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        for d in manifest["dumps"]:
            print(f"step {d['step']} bucket {d['bucket']}: {d['elements']} elements -> {d['files'][0]} ...")
    dist.barrier()  # rank 0 hosts the store: nobody may leave while others still use it
    # destroy_process_group() sometimes spins forever in rank 0 at 8 ranks on a loaded machine;
    # everything is written, so leave without tearing Gloo down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def aligned_layout(sizes, quantum=256, min_aligned=4096):
    """(offsets, total) of a bucket's tensors in the aligned layout: tensors of >= min_aligned
    elements or of a multiple of `quantum` first, in bucket order, each starting on a 256-element
    super-group (zero padding after it); the others packed after them. Mirrors the layout
    proposed for dynamiq.torch.allreduce_hook in docs/codec_real_gradients.md."""
    offsets, total = [0] * len(sizes), 0
    aligned = [n >= min_aligned or n % quantum == 0 for n in sizes]
    for i, n in enumerate(sizes):
        if aligned[i]:
            offsets[i] = total
            total += -(-n // quantum) * quantum
    for i, n in enumerate(sizes):
        if not aligned[i]:
            offsets[i] = total
            total += n
    return offsets, total


def write_aligned(manifest_path):
    import numpy as np
    with open(manifest_path) as f:
        manifest = json.load(f)
    for d in manifest["dumps"]:
        sizes = [int(np.prod(p["shape"])) for p in d["parameters"]]
        offsets, total = aligned_layout(sizes)
        files = []
        for path in d["files"]:
            x = np.fromfile(path, dtype="<f4")
            y = np.zeros(total, dtype="<f4")
            for p, n, dst in zip(d["parameters"], sizes, offsets):
                y[dst:dst + n] = x[p["offset"]:p["offset"] + n]
            stem, rank = path.rsplit("_r", 1)
            files.append(f"{stem}_aligned_r{rank}")
            y.tofile(files[-1])
        # The same wire bits per original coordinate: the padding travels too.
        scale = d["elements"] / total
        print(f"# step {d['step']} bucket {d['bucket']}: {d['elements']} -> {total} elements; DynamiQ b̄ 5 at equal "
              f"wire bits is --bits={5 * scale:.4f}")
        print(f"dynamiq-bench codec --workers={len(files)} --codec=dynamiq --bits={5 * scale:.4f} "
              f"--input={','.join(files)}")


def main():
    args = parse_args()
    if args.align:
        write_aligned(args.align)
        return
    os.makedirs(args.out, exist_ok=True)
    import torch.multiprocessing as mp
    with socket.socket() as s:  # a free loopback port for the Gloo rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args, f"tcp://127.0.0.1:{port}"), nprocs=args.workers, join=True)


if __name__ == "__main__":
    main()
