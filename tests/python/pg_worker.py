"""One worker process of test_process_group.py: `pg_worker.py MODE OUT_DIR`, with RANK, WORLD_SIZE
and the DQ_* variables set by the test. Initializes torch.distributed with the "dynamiq" backend
(file:// store in OUT_DIR) and writes OUT_DIR/rank<r>.pt (a dict) for the test to check; an
exception is saved as {"error": type: message} instead.

Modes:
  collectives  every collective: all_reduce SUM/AVG of each float dtype (daemon), sync and async,
               exact() and small tensors (Gloo), MAX/MIN/int64, broadcast, all_gather,
               reduce_scatter, barrier, unsupported dtype/device errors.
  ddp          DDP without a hook next to DDP with dynamiq.torch's hook, same data, 3 steps.
  init         only init_process_group (for the error cases: missing daemon, wrong world size).
  ddp_error    DDP without a hook, but rank 1 all-reduces an extra tensor first: the daemon fails
               the collective (the workers submitted different tensors) and DDP raises it from
               backward() on rank 0, the extra all_reduce raises it on rank 1.
  cuda         (needs a GPU and --device=cuda daemons) all_reduce of CUDA tensors (SUM, AVG, bf16),
               which must use device buffers, and one DDP step of a CUDA model next to each rank's
               local gradient.
  die          all_reduce once, write OUT_DIR/ready<r>, rank 1 then waits for OUT_DIR/go before its
               second all_reduce (the test kills the daemon meanwhile); records the error and time.
  train        DDP without a hook, two buckets of different sizes, PG_STEPS (default 30) SGD steps;
               records the group's per-call records and the learned period.
  empty        zero-element all_reduce (SUM, AVG, async), all_reduce_coalesced and reduce_scatter,
               then a 5000-element all_reduce (run with DQ_TORCH_EXACT_BELOW=0).
  exit         three DDP steps, then the process ends without closing anything (exit_destroy:
               after dist.destroy_process_group(); exit_async: after starting 8 all_reduces and
               waiting for the first only); the test checks the exit code.
  init_env     only init_process_group, env:// (MASTER_ADDR, MASTER_PORT) with timeout PG_TIMEOUT
               seconds; records the error and how long init took.
  groups       dist.new_group for each entry of PG_GROUPS ("all" or ranks like "0,3", separated by
               ";"; the rows and columns of a device mesh, say): each group's job and path, an
               async SUM and an AVG on every group of the rank and on the default group, waited in
               reverse order, a broadcast and an all_gather on each group, then the daemon's jobs on
               this rank's node (PG_CONTROL) before and after dist.destroy_process_group of the
               first group, and a SUM on the last group after it.
  group_on_gloo  new_group(backend="dynamiq") under a gloo default group: records the error.
"""

import _thread
import copy
import datetime
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist

import dynamiq.torch

# Values k * 2^-6 with |k| < 2^10: sums over a few ranks are exact in fp32 in any order.
SCALE = 2.0 ** -6


def values(rank, n, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return (torch.randint(-1000, 1000, (n,), generator=g).to(torch.float32) * SCALE).to(dtype)


def exact_sum(world, n, seed):
    return sum(values(r, n, seed) for r in range(world))


def collectives(rank, world, pg):
    out = {}
    n = 50_000
    # SUM through the daemon (compressed between nodes with the job's codec), every rank identical.
    t = values(rank, n, 1)
    dist.all_reduce(t)
    out["sum"] = t
    out["sum_want"] = exact_sum(world, n, 1)
    # AVG, bf16 and fp16 through the daemon; async with several in flight, waited out of order.
    tensors = {"avg": values(rank, n, 2), "bf16": values(rank, n, 3, torch.bfloat16),
               "fp16": values(rank, n, 4, torch.float16)}
    works = {"avg": dist.all_reduce(tensors["avg"], op=dist.ReduceOp.AVG, async_op=True),
             "bf16": dist.all_reduce(tensors["bf16"], async_op=True),
             "fp16": dist.all_reduce(tensors["fp16"], async_op=True)}
    out["async_types"] = sorted({type(w).__name__ for w in works.values()})
    for key in ("fp16", "bf16", "avg"):
        assert works[key].wait() is True
        assert works[key].is_completed()
        out[key] = tensors[key]
    out["future_value"] = bool(works["avg"].get_future().wait()[0] is tensors["avg"])
    out["avg_want"] = exact_sum(world, n, 2) / world
    # allreduce called from C with no Python frame above it, as DDP's reducer calls it from a CUDA
    # autograd thread: the backend gives C++ a Work (it once raised "call stack is not deep enough").
    # extend() and map() are C, so pg.allreduce's frame is the thread's first.
    t, works = values(rank, n, 8), []
    _thread.start_new_thread(works.extend, (map(pg.allreduce, [[t]]),))
    deadline = time.monotonic() + 60
    while not works and time.monotonic() < deadline:
        time.sleep(0.01)
    out["c_caller_work"] = type(works[0]).__name__ if works else None
    if works:
        works[0].wait()
    out["c_caller_sum"], out["c_caller_want"] = t, exact_sum(world, n, 8)
    # exact(): the same size, exact, through the inner Gloo group.
    records_before = len(pg.records)
    t = values(rank, n, 1)
    with dynamiq.torch.exact():
        dist.all_reduce(t)
        a = values(rank, n, 2)
        dist.all_reduce(a, op=dist.ReduceOp.AVG)
    out["exact_sum"], out["exact_avg"] = t, a
    # Below exact_below: exact without asking (a loss scalar).
    loss = torch.tensor([float(rank) * 0.1 + 1 / 3])
    dist.all_reduce(loss)
    out["loss"] = loss
    out["daemon_calls_exact"] = len(pg.records) - records_before
    # MAX / MIN / int64: exact on Gloo.
    m = values(rank, 1000, 5)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["max"] = m
    m = values(rank, 1000, 5)
    dist.all_reduce(m, op=dist.ReduceOp.MIN)
    out["min"] = m
    product = torch.full((4,), float(rank + 1))
    dist.all_reduce(product, op=dist.ReduceOp.PRODUCT)
    out["product"] = product
    count = torch.tensor([rank + 1, 10 * rank], dtype=torch.int64)
    dist.all_reduce(count)
    out["int64"] = count
    # broadcast, all_gather, reduce_scatter (daemon and exact), barrier.
    b = values(rank, 3000, 6)
    dist.broadcast(b, src=world - 1)
    out["broadcast"] = b
    gathered = [torch.zeros(5) for _ in range(world)]
    dist.all_gather(gathered, torch.full((5,), float(rank)))
    out["all_gather"] = torch.stack(gathered)
    inputs = [values(rank * world + i, 20_000, 7) for i in range(world)]
    rs = torch.zeros(20_000)
    dist.reduce_scatter(rs, inputs)
    out["reduce_scatter"] = rs
    with dynamiq.torch.exact():
        rs_exact = torch.zeros(20_000)
        dist.reduce_scatter(rs_exact, [x.clone() for x in inputs])
    out["reduce_scatter_exact"] = rs_exact
    out["reduce_scatter_want"] = sum(values(r * world + rank, 20_000, 7) for r in range(world))
    dist.barrier()
    # Errors: unsupported dtype and device.
    errors = {}
    for key, tensor in (("bool", torch.zeros(4, dtype=torch.bool)), ("meta", torch.zeros(4, device="meta")),
                        ("sparse_csr", torch.eye(4).to_sparse_csr())):
        try:
            dist.all_reduce(tensor)
            errors[key] = None
        except (TypeError, ValueError, RuntimeError) as e:
            errors[key] = f"{type(e).__name__}: {e}"
    try:
        dist.all_reduce(torch.ones(4), op=dist.ReduceOp.BAND)
        errors["band"] = None
    except ValueError as e:
        errors["band"] = f"{type(e).__name__}: {e}"
    out["errors"] = errors
    # A sparse COO tensor: Gloo's sparse all-reduce, as on the gloo backend.
    sparse = torch.sparse_coo_tensor([[rank, world]], [float(rank + 1), 1.0], (world + 1,))
    dist.all_reduce(sparse)
    out["sparse"] = sparse.to_dense()
    out["records"] = list(pg.records)
    return out


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 64), torch.nn.ReLU(),
                               torch.nn.Linear(64, 10))


def ddp(rank, world, pg):
    net = model()
    hooked_net = copy.deepcopy(net)
    plain = torch.nn.parallel.DistributedDataParallel(net)  # no hook: DDP's all-reduces reach the group
    hooked = torch.nn.parallel.DistributedDataParallel(hooked_net)
    state = dynamiq.torch.DynamiqState(client=pg.client, name_prefix="hook")
    hooked.register_comm_hook(state, dynamiq.torch.allreduce_hook)
    steps = []
    for step in range(3):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randint(0, 10, (16,), generator=g)
        grads = {}
        for key, m in (("plain", plain), ("hooked", hooked)):
            m.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(m(x), y).backward()
            grads[key] = [p.grad.clone() for p in m.parameters()]
        steps.append(grads)
    state.close()
    return {"steps": steps, "records": list(pg.records)}


def ddp_error(rank, world, pg):
    plain = torch.nn.parallel.DistributedDataParallel(model())
    x, y = torch.randn(16, 64), torch.randint(0, 10, (16,))
    try:
        if rank == 1:
            dist.all_reduce(torch.ones(5000))
        torch.nn.functional.cross_entropy(plain(x), y).backward()
        return {"ddp_error": None}
    except RuntimeError as e:
        return {"ddp_error": str(e)}


def die(rank, world, pg, out_dir):
    t = torch.ones(100_000)
    dist.all_reduce(t)
    open(os.path.join(out_dir, f"ready{rank}"), "w").close()
    if rank == 1:
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(out_dir, "go")) and time.monotonic() < deadline:
            time.sleep(0.05)
    started = time.monotonic()
    try:
        dist.all_reduce(t)
        return {"died_error": None}
    except RuntimeError as e:
        return {"died_error": str(e), "seconds": time.monotonic() - started}


def train(rank, world, pg):
    # DDP puts the first 20 kB in a bucket and then 50 kB per bucket (torch 1.13 reads the first
    # limit from this module attribute): buckets of 8906 and 8320 elements.
    dist._DEFAULT_FIRST_BUCKET_BYTES = 20000
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64), torch.nn.ReLU(),
                              torch.nn.Linear(64, 10))
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(int(os.environ.get("PG_STEPS", "30"))):
        x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return {"records": list(pg.records), "period": getattr(getattr(pg, "_names", None), "period", None),
            "losses": losses}


def empty(rank, world, pg):
    out = {}
    t = torch.zeros(0)
    dist.all_reduce(t)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    work = dist.all_reduce(torch.zeros(0, dtype=torch.bfloat16), async_op=True)
    out["async_completed"] = work.is_completed()
    work.wait()
    dist.all_reduce_coalesced([torch.zeros(0), torch.zeros(0)])
    out_rs = torch.zeros(0)
    dist.reduce_scatter(out_rs, [torch.zeros(0) for _ in range(world)])
    out["daemon_calls"] = len(pg.records)
    t = values(rank, 5000, 9)
    dist.all_reduce(t)
    out["after"], out["after_want"] = t, exact_sum(world, 5000, 9)
    out["records"] = list(pg.records)
    return out


def node_jobs(control):
    """{job id: workers} of the jobs this rank's node's dynamiqd runs."""
    return {j["job_id"]: j["workers"] for j in dynamiq.Control(control).status()["jobs"]}


def groups(rank, world, pg):
    out = {}
    n = 50_000
    made = {}
    for i, spec in enumerate(os.environ["PG_GROUPS"].split(";")):
        made[f"{i}:{spec}"] = dist.new_group() if spec == "all" else dist.new_group([int(r) for r in spec.split(",")])
    mine = {key: g for key, g in made.items() if g is not dist.GroupMember.NON_GROUP_MEMBER}
    out["info"] = {key: None for key in made}
    for key, g in mine.items():
        p = dynamiq.torch.get_process_group(g)
        out["info"][key] = {"job": p.job, "uses_daemon": p.uses_daemon, "global_ranks": p.global_ranks,
                            "rank": dist.get_rank(g), "size": dist.get_world_size(g)}
    # Interleaved: every group of this rank and the default group (None) in flight at once; the
    # seeds go by the place in the list of all groups (the same on every rank).
    sums, avgs, works = {}, {}, []
    for i, key in enumerate(list(made) + ["world"]):
        if key != "world" and key not in mine:
            continue
        g = mine.get(key)
        sums[key], avgs[key] = values(rank, n, 10 + i), values(rank, n, 40 + i)
        works.append(dist.all_reduce(sums[key], group=g, async_op=True))
        works.append(dist.all_reduce(avgs[key], op=dist.ReduceOp.AVG, group=g, async_op=True))
    for w in reversed(works):
        w.wait()
    out["sum"], out["avg"] = sums, avgs
    out["records"] = {key: list(dynamiq.torch.get_process_group(g).records) for key, g in mine.items()}
    out["exact_collectives"] = {key: dynamiq.torch.get_process_group(g).exact_collectives for key, g in mine.items()}
    out["broadcast"], out["all_gather"] = {}, {}
    for key, g in mine.items():
        b = torch.full((3,), float(rank))
        dist.broadcast(b, src=out["info"][key]["global_ranks"][-1], group=g)
        out["broadcast"][key] = b
        gathered = [torch.zeros(2) for _ in range(dist.get_world_size(g))]
        dist.all_gather(gathered, torch.full((2,), float(rank)), group=g)
        out["all_gather"][key] = torch.stack(gathered)
    # destroy_process_group(first group) unregisters its members from the daemon.
    # Every rank looks before any rank destroys (a rank that destroyed first would be missing).
    first = next(iter(made))
    dist.barrier()
    out["jobs_before"] = node_jobs(os.environ["PG_CONTROL"])
    dist.barrier()
    dist.destroy_process_group(made[first])
    dist.barrier()
    job = (out["info"][first] or {}).get("job")
    deadline = time.monotonic() + 30
    while job in node_jobs(os.environ["PG_CONTROL"]) and time.monotonic() < deadline:
        time.sleep(0.05)
    out["jobs_after"] = node_jobs(os.environ["PG_CONTROL"])
    last = list(made)[-1]
    if last in mine and last != first:
        t = values(rank, n, 60)
        dist.all_reduce(t, group=mine[last])
        out["after_destroy"] = t
    return out


def group_on_gloo():
    try:
        dist.new_group(backend="dynamiq")
        return {"group_error": None}
    except ValueError as e:
        return {"group_error": str(e)}


def cuda(rank, world, pg):
    out = {}
    n = 50_000
    t = values(rank, n, 1).cuda()
    dist.all_reduce(t)
    out["sum"] = t.cpu()
    out["sum_want"] = exact_sum(world, n, 1)
    t = values(rank, n, 2, torch.bfloat16).cuda()
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    out["bf16_avg"] = t.cpu()
    out["bf16_avg_want"] = (sum(values(r, n, 2, torch.bfloat16).float() for r in range(world)) / world).to(
        torch.bfloat16)
    out["devices"] = sorted({str(t.device)})
    out["memory"] = sorted({s.buffer.memory for s in pg._pool._free})
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(), torch.nn.Linear(300, 8)).cuda()
    local = copy.deepcopy(net)
    model = torch.nn.parallel.DistributedDataParallel(net)
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=g).cuda(), torch.randn(16, 8, generator=g).cuda()
    torch.nn.functional.mse_loss(model(x), y).backward()
    torch.nn.functional.mse_loss(local(x), y).backward()
    out["ddp_grads"] = [p.grad.cpu() for p in net.parameters()]
    out["local_grads"] = [p.grad.cpu() for p in local.parameters()]
    return out


def main():
    mode, out_dir = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    if mode == "init_env":
        started = time.monotonic()
        try:
            dist.init_process_group("dynamiq", timeout=datetime.timedelta(seconds=float(os.environ["PG_TIMEOUT"])))
            torch.save({"error": None}, path)
        except RuntimeError as e:
            torch.save({"error": str(e), "seconds": time.monotonic() - started}, path)
        return
    try:
        backend = "gloo" if mode == "group_on_gloo" else "dynamiq"
        dist.init_process_group(backend, init_method=f"file://{out_dir}/pg-store", rank=rank, world_size=world)
        pg = dynamiq.torch.get_process_group() if backend == "dynamiq" else dist.group.WORLD
        result = {"backend": dist.get_backend()}
        if mode == "collectives":
            result.update(collectives(rank, world, pg))
        elif mode == "ddp":
            result.update(ddp(rank, world, pg))
        elif mode == "ddp_error":
            result.update(ddp_error(rank, world, pg))
        elif mode == "cuda":
            result.update(cuda(rank, world, pg))
        elif mode == "die":
            result.update(die(rank, world, pg, out_dir))
        elif mode == "train":
            result.update(train(rank, world, pg))
        elif mode == "empty":
            result.update(empty(rank, world, pg))
        elif mode == "groups":
            result.update(groups(rank, world, pg))
        elif mode == "group_on_gloo":
            result.update(group_on_gloo())
        elif mode in ("exit", "exit_destroy", "exit_async"):
            # Three DDP steps, then the end of the script: nothing closes the group but the
            # backend itself (at destroy_process_group, or at the interpreter's exit).
            net = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 64))
            for _ in range(3):
                net(torch.randn(8, 64)).sum().backward()
            if mode == "exit_destroy":
                dist.destroy_process_group()
            if mode == "exit_async":
                works = [dist.all_reduce(torch.ones(5000 + i), async_op=True) for i in range(8)]
                works[0].wait()
            return
    except Exception as e:  # noqa: BLE001 -- the test checks the message
        traceback.print_exc()
        torch.save({"error": f"{type(e).__name__}: {e}"}, path)
        return
    torch.save(result, path)
    if backend == "dynamiq":
        pg.close()


if __name__ == "__main__":
    main()
