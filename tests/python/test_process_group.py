"""The torch.distributed backend "dynamiq" (dynamiq.torch.ProcessGroupDynamiq) against real dynamiqd
daemons: every collective, async Work, the exact override, DDP without a hook (bit-identical to the
hook path with codec none), and the errors (missing daemon, wrong world size, duplicate local
rank, unsupported dtype/device, a daemon killed mid-collective). Workers: pg_worker.py."""

import json
import os
import re
import subprocess
import sys
import threading
import time

import torch

from conftest import HERE, REPO, WORKER_SECONDS, free_ports, run_workers, worker_envs
from pg_worker import values

WORKER = os.path.join(HERE, "pg_worker.py")


def vnmse(got, want):
    return float(((got.double() - want.double()) ** 2).sum() / (want.double() ** 2).sum())


def run(mode, envs, workdir, timeout=None):
    args = [WORKER, mode, workdir]
    results = run_workers(args, envs) if timeout is None else run_workers(args, envs, timeout=timeout)
    for code, out in results:
        assert code == 0, out[-4000:]
    return [torch.load(os.path.join(workdir, f"rank{r}.pt")) for r in range(len(envs))]


def test_every_collective_on_two_compressed_nodes(cluster, workdir):
    # DynamiQ 4-bit between the nodes, on every tensor size: what reaches the daemon is compressed,
    # what exact() and exact_below route to Gloo is not.
    c = cluster(nodes=2, codec="dynamiq", bits=4, min_compress_elements=0)
    ranks = run("collectives", worker_envs(c, 2, 2, "pg"), workdir)
    for r, x in enumerate(ranks):
        assert "error" not in x, x.get("error")
        assert x["backend"] == "dynamiq"
        # Through the daemon: compressed (not exact, but close) and bit-identical on every rank.
        for key, want in (("sum", "sum_want"), ("avg", "avg_want")):
            assert 0 < vnmse(x[key], x[want]) < 0.2, (key, vnmse(x[key], x[want]))
            assert torch.equal(x[key], ranks[0][key])
        for key in ("bf16", "fp16"):
            assert x[key].dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[key]
            assert torch.equal(x[key], ranks[0][key])
        assert x["async_types"] == ["_PythonWork"] and x["future_value"]
        assert x["c_caller_work"] is not None and x["c_caller_work"] != "_PythonWork"
        assert 0 < vnmse(x["c_caller_sum"], x["c_caller_want"]) < 0.2
        assert torch.equal(x["c_caller_sum"], ranks[0]["c_caller_sum"])
        # The daemon ran them with the job's codec: sequence numbers in order, wire bytes ~4 bits.
        daemon = x["records"]
        assert [d["codec"] for d in daemon] == ["dynamiq"] * len(daemon)
        assert [d["sequence"] for d in daemon] == list(range(len(daemon)))
        assert daemon[0]["elements"] == 50_000 and daemon[0]["wire_bytes"] < 50_000 * 4 * 0.15
        # exact() and a loss scalar: exact, and none of them reached the daemon.
        assert torch.equal(x["exact_sum"], x["sum_want"])
        assert torch.equal(x["exact_avg"], x["avg_want"])
        assert torch.allclose(x["loss"], torch.tensor([0.6 + 4 / 3]))
        assert x["daemon_calls_exact"] == 0
        # MAX/MIN/int64 on Gloo.
        inputs = torch.stack([values(q, 1000, 5) for q in range(4)])
        assert torch.equal(x["max"], inputs.max(0).values)
        assert torch.equal(x["min"], inputs.min(0).values)
        assert x["int64"].tolist() == [10, 60]
        assert x["product"].tolist() == [24.0] * 4
        assert torch.equal(x["broadcast"], values(3, 3000, 6))
        assert torch.equal(x["all_gather"], torch.arange(4.0).repeat_interleave(5).reshape(4, 5))
        # reduce_scatter: rank r gets slot r of the all-reduced inputs; compressed, or exact in exact().
        assert 0 < vnmse(x["reduce_scatter"], x["reduce_scatter_want"]) < 0.2
        assert torch.equal(x["reduce_scatter_exact"], x["reduce_scatter_want"])
        errors = x["errors"]
        assert errors["bool"].startswith("TypeError: dynamiq backend: allreduce of torch.bool tensors is not supported")
        assert errors["meta"].startswith("ValueError: dynamiq backend: allreduce takes CPU or CUDA tensors")
        assert errors["sparse_csr"].startswith("ValueError: dynamiq backend: allreduce takes dense tensors")
        assert x["sparse"].tolist() == [1.0, 2.0, 3.0, 4.0, 4.0]
        assert errors["band"].startswith("ValueError: dynamiq backend: allreduce does not support op BAND")


def test_ddp_without_hook_equals_the_hook_path(cluster, workdir):
    # Codec none: the daemon sums exactly, so DDP's own all-reduce through the backend and the
    # communication hook give bit-identical gradients (DDP pre-divides by 4, the hook averages).
    c = cluster(nodes=2, codec="none")
    ranks = run("ddp", worker_envs(c, 2, 2, "ddp"), workdir)
    for x in ranks:
        assert "error" not in x, x.get("error")
        for step in x["steps"]:
            for plain, hooked in zip(step["plain"], step["hooked"]):
                assert torch.equal(plain, hooked)
        for step, first in zip(x["steps"], ranks[0]["steps"]):
            assert all(torch.equal(a, b) for a, b in zip(step["plain"], first["plain"]))
        # DDP's bucket reached the daemon as the backend's all-reduce, one per step, under one
        # name every step (dynamiq/_names.py: the period of the calls is one).
        names = [r["name"] for r in x["records"]]
        assert len(names) == 3 and len(set(names)) == 1, names
        assert names[0].startswith("torch.allreduce.float32."), names


def test_ddp_without_hook_raises_the_daemons_error_from_backward(cluster, workdir):
    c = cluster(nodes=1, codec="none")
    ranks = run("ddp_error", worker_envs(c, 1, 2, "ddperr"), workdir)
    for r, x in enumerate(ranks):
        assert "error" not in x, x.get("error")
        assert x["ddp_error"] is not None, r
        # The daemon's message names both submissions; DDP wraps it (rank 0), dist.all_reduce not.
        assert "INVALID_ARGUMENT" in x["ddp_error"] and "submitted" in x["ddp_error"], x["ddp_error"]
    assert ranks[1]["ddp_error"].startswith("dynamiq backend: all-reduce 'torch.allreduce.float32.5000.0' "
                                            "(5000 x torch.float32) failed: INVALID_ARGUMENT")


def test_missing_daemon_is_a_clear_error(workdir):
    env = dict(RANK="0", WORLD_SIZE="1", DQ_SOCKET=os.path.join(workdir, "nobody.sock"), DQ_JOB="j",
               DQ_LOCAL_RANK="0", DQ_LOCAL_WORLD_SIZE="1")
    (x,) = run("init", [env], workdir)
    assert x["error"].startswith("RuntimeError: dynamiq backend: rank 0 cannot register with dynamiqd at ")
    assert "is dynamiqd running on this node?" in x["error"] and "UNAVAILABLE" in x["error"]


def test_wrong_world_size_and_duplicate_local_rank(node, workdir):
    # One process, but DQ_LOCAL_WORLD_SIZE says the node runs two workers of the job.
    env = dict(RANK="0", WORLD_SIZE="1", DQ_SOCKET=node.socket, DQ_JOB="world", DQ_LOCAL_RANK="0",
               DQ_LOCAL_WORLD_SIZE="2")
    (x,) = run("init", [env], workdir)
    assert x["error"].startswith("ValueError: dynamiq backend: world size 1 (rank 0) does not match job 'world'")
    assert "node 0 has 1 ranks of the group, but DQ_LOCAL_WORLD_SIZE=2" in x["error"]
    # Two processes claiming local rank 0: the daemon refuses the second, the first names it.
    os.remove(os.path.join(workdir, "rank0.pt"))
    envs = [dict(env, RANK=str(r), WORLD_SIZE="2", DQ_JOB="dup") for r in range(2)]
    started = time.monotonic()
    xs = run("init", envs, workdir)
    assert time.monotonic() - started < 60
    errors = sorted(x["error"] for x in xs)
    assert any("refused its registration (another process of this node already has local rank 0" in e
               for e in errors), errors
    assert not any("is dynamiqd running" in e for e in errors), errors  # the daemon answered
    assert any("failed to join" in e or "both local rank 0" in e for e in errors), errors


def test_startup_errors_say_what_was_wrong_and_which_variable_to_set(node, workdir, monkeypatch):
    """Issue 44.5: the DQ_SOCKET hint only when no daemon answered, and a message naming the
    variable for a defaulted local rank or local world size, a bad or differing DQ_TORCH_EXACT_BELOW."""
    for var in ("DQ_LOCAL_RANK", "LOCAL_RANK", "DQ_LOCAL_WORLD_SIZE", "LOCAL_WORLD_SIZE", "DQ_TORCH_EXACT_BELOW"):
        monkeypatch.delenv(var, raising=False)
    base = dict(DQ_SOCKET=node.socket)

    def init(envs):
        for r in range(len(envs)):
            path = os.path.join(workdir, f"rank{r}.pt")
            if os.path.exists(path):
                os.remove(path)
        for f in os.listdir(workdir):
            if f.startswith("pg-store"):
                os.remove(os.path.join(workdir, f))
        return [x["error"] for x in run("init", envs, workdir)]

    # Two ranks without a local rank: both take 0, and the daemon (which answered) refuses one.
    errors = init([dict(base, RANK=str(r), WORLD_SIZE="2", DQ_JOB="nolocal", DQ_LOCAL_WORLD_SIZE="2")
                   for r in range(2)])
    assert all(e for e in errors), errors
    assert not any("is dynamiqd running" in e for e in errors), errors
    assert any("neither DQ_LOCAL_RANK nor LOCAL_RANK is set" in e and "set DQ_LOCAL_RANK" in e for e in errors), errors
    # A local rank without a local world size: it says the size defaulted to 1, and what to set.
    (e,) = init([dict(base, RANK="0", WORLD_SIZE="1", DQ_JOB="noworld", LOCAL_RANK="1")])
    assert "neither DQ_LOCAL_WORLD_SIZE nor LOCAL_WORLD_SIZE is set (it defaulted to 1)" in e, e
    assert "is not below" not in e and "is dynamiqd running" not in e, e
    # A bad DQ_TORCH_EXACT_BELOW is named, not a bare int() error.
    one = dict(base, RANK="0", WORLD_SIZE="1", DQ_JOB="exact", DQ_LOCAL_RANK="0", DQ_LOCAL_WORLD_SIZE="1")
    (e,) = init([dict(one, DQ_TORCH_EXACT_BELOW="abc")])
    assert e.startswith("ValueError: dynamiq backend: DQ_TORCH_EXACT_BELOW must be a whole number"), e
    assert "'abc'" in e and "invalid literal" not in e, e
    (e,) = init([dict(one, DQ_LOCAL_RANK="x")])
    assert "DQ_LOCAL_RANK must be a whole number, 0 or more, got 'x'" in e, e
    # Ranks whose DQ_TORCH_EXACT_BELOW differ: that is the error, not a world-size mismatch.
    errors = init([dict(base, RANK=str(r), WORLD_SIZE="2", DQ_JOB="differ", DQ_LOCAL_RANK=str(r),
                        DQ_LOCAL_WORLD_SIZE="2", DQ_TORCH_EXACT_BELOW=str(100 * (r + 1))) for r in range(2)])
    for e in errors:
        assert "disagree on a setting" in e and "DQ_TORCH_EXACT_BELOW" in e, errors
        assert "world size" not in e, errors


def test_daemon_killed_mid_collective_raises(cluster, workdir):
    c = cluster(nodes=1, codec="none")
    envs = worker_envs(c, 1, 2, "die")
    procs_done = []

    def kill_when_ready():
        deadline = time.monotonic() + 60
        while not all(os.path.exists(os.path.join(workdir, f"ready{r}")) for r in range(2)):
            assert time.monotonic() < deadline, "workers never got ready"
            time.sleep(0.05)
        time.sleep(0.5)  # rank 0's second all-reduce is now waiting in the daemon for rank 1
        c.procs[0].kill()
        c.procs[0].wait()
        open(os.path.join(workdir, "go"), "w").close()
        procs_done.append(True)

    killer = threading.Thread(target=kill_when_ready)
    killer.start()
    started = time.monotonic()
    xs = run("die", envs, workdir, timeout=60)
    killer.join()
    assert procs_done == [True]
    # DQ_TIMEOUT_SECONDS is 30 in run_workers: both fail well before it, with the daemon's error.
    assert time.monotonic() - started < 30
    for x in xs:
        assert x["died_error"] is not None
        # The same tensor twice: the second call repeats the first's name.
        assert x["died_error"].startswith("dynamiq backend: all-reduce 'torch.allreduce.float32.100000.0' "
                                          "(100000 x torch.float32) failed: UNAVAILABLE"), x["died_error"]
        assert x["seconds"] < 20


def test_train_py_trains_ddp_on_the_backend_without_a_hook():
    # examples/train.py --comm backend: dist.init_process_group("dynamiq"), DDP without a hook.
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "examples", "train.py"), "--nodes=2", "--workers-per-node=1",
         "--comm=backend", "--codec=dynamiq", "--bits=5", "--steps=60", "--eval-every=30", "--json", "--timeout=80"],
        capture_output=True, text=True, timeout=WORKER_SECONDS)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout)
    loss = result["loss"]
    assert len(loss) == 60
    assert sum(loss[-10:]) / 10 < 0.25 * sum(loss[:5]) / 5, loss
    assert result["final_test_accuracy"] > 0.9, result["eval"]
    assert result["comm"] == "backend" and result["codec_reported"] == ["dynamiq"]
    assert result["wire_bytes_per_step"] > 0


def train_records(cluster, workdir, job, steps):
    """The records of `steps` DDP steps (pg_worker.py train) on 2 nodes: DDP's first iteration
    all-reduces one bucket of all 17226 parameters, later ones its two rebuilt buckets."""
    ranks = run("train", [dict(e, PG_STEPS=str(steps)) for e in worker_envs(cluster, 2, 1, job)], workdir)
    for x in ranks:
        assert "error" not in x, x.get("error")
        assert [r["elements"] for r in x["records"]] == [17226] + [8906, 8320] * (steps - 1)
        # The two buckets are named alike every step and on every rank.
        assert x["period"] == 2
        names = [r["name"] for r in x["records"]]
        assert len(set(names[:3])) == 3 and names[1:] == names[1:3] * (steps - 1), names
        assert names == [r["name"] for r in ranks[0]["records"]]
    return ranks[0]["records"]


def test_arc_topk_error_feedback_compresses_every_call_after_the_first_step(cluster, workdir):
    # dynamiqd keeps error feedback per collective name. The backend once named every call anew
    # ("torch.allreduce.<seq>"): each went dense (the feedback's first step), and once the state
    # reached --error_feedback_mib every later collective failed RESOURCE_EXHAUSTED. Now DDP's
    # buckets repeat their names: dense once, then compressed, within a 1 MiB limit (the two
    # buckets' state is 140 kB; 12 steps of new names would be 1.6 MB).
    c = cluster(nodes=2, codec="arc_topk", bits=0.1, min_compress_elements=0, arc_topk_error_feedback="true",
                error_feedback_mib=1)
    records = train_records(c, workdir, "ef", 12)
    for i, r in enumerate(records):
        dense = 4 * r["elements"]
        if i < 3:
            # The feedback's first step of each name is dense and exact: DDP's first iteration,
            # then the first of its rebuilt buckets.
            assert r["wire_bytes"] > 0.9 * dense, (i, r)
        else:
            assert r["wire_bytes"] < 0.3 * dense, (i, r)
        assert r["codec"] == "arc_topk"


def test_step_budget_plans_the_backends_buckets(cluster, workdir):
    # --step_budget splits the job's bits across a step's buckets once a bucket's name comes round
    # again: with a new name per call it never did (and its per-bucket records grew without bound).
    c = cluster(nodes=2, codec="dynamiq", bits=4, min_compress_elements=0, step_budget="true")
    records = train_records(c, workdir, "budget", 8)
    first = [r["wire_bytes"] for r in records[1:3]]
    late = [r["wire_bytes"] for r in records[-2:]]
    # From the second step on each bucket runs at its share: not what the job's 4 bits give it.
    assert late[0] != first[0] and late[1] != first[1], (first, late)
    assert 0.8 * sum(first) < sum(late) < 1.2 * sum(first)  # the step's budget is the same
    for r in records:
        assert r["wire_bytes"] < 0.2 * 4 * r["elements"]


def test_zero_size_all_reduce_is_a_no_op_on_every_rank(node, workdir):
    # DQ_TORCH_EXACT_BELOW=0 sends every size to the daemon, which refuses an empty all-reduce
    # (INVALID_ARGUMENT); torch's backends complete it at once, and now so does this one.
    envs = [dict(e, DQ_TORCH_EXACT_BELOW="0") for e in worker_envs(node, 1, 2, "empty")]
    for x in run("empty", envs, workdir):
        assert "error" not in x, x.get("error")
        assert x["async_completed"]
        assert x["daemon_calls"] == 0
        assert torch.equal(x["after"], x["after_want"])  # the ranks still agree on what comes next
        assert [r["elements"] for r in x["records"]] == [5000]


def test_a_rank_that_never_joins_fails_init_within_the_timeout_and_says_how_long(node, workdir):
    # env:// rendezvous: torch's TCPStore on rank 0 waits the whole timeout for the other ranks
    # before the group exists. The group's own wait used to add another timeout on top (12 s for a
    # timeout of 6) while the error said "within 6 s".
    env = dict(RANK="0", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_ports(1)[0]),
               PG_TIMEOUT="6", DQ_SOCKET=node.socket, DQ_JOB="never", DQ_LOCAL_RANK="0", DQ_LOCAL_WORLD_SIZE="1")
    (x,) = run("init_env", [env], workdir)
    assert x["error"] is not None
    assert x["seconds"] < 6 + 3, x
    m = re.search(r"not every rank of the world of 2 joined within (\d+) s of init_process_group \(timeout 6 s;",
                  x["error"])
    assert m, x["error"]
    assert abs(int(m.group(1)) - x["seconds"]) < 1.5, x


def test_backend_processes_exit_cleanly(node, workdir):
    # The completion thread was still inside torch when Python shut down, and a thread that wakes
    # up then to take the GIL is ended by a forced unwind that torch's noexcept frames turn into
    # "terminate called without an active exception" (SIGABRT). Before the backend closed its
    # groups at destroy_process_group and at exit, 3 of 24 processes died so after DDP steps, and 6
    # of 8 that exited with all-reduces in flight: these 4 jobs of 2 ranks failed almost always
    # (all 8 runs of the test on the old code).
    failures = []
    deadline = time.monotonic() + 240
    modes = ("exit_async", "exit", "exit_async", "exit_destroy")
    for i, mode in enumerate(modes):
        assert time.monotonic() < deadline, f"only {i} of {len(modes)} jobs ran within 240 s"
        out_dir = os.path.join(workdir, f"exit{i}")
        os.mkdir(out_dir)
        results = run_workers([WORKER, mode, out_dir], worker_envs(node, 1, 2, f"exit{i}"))
        failures += [(i, mode, code, out[-500:]) for code, out in results if code != 0]
    assert not failures, failures
