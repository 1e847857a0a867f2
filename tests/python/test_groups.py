"""Process groups beyond the default on the "dynamiq" backend (issue 43): dist.new_group (also as
the rows and columns of a device mesh; torch 1.13's new_subgroups wants CUDA), each group a sub-job
of the job in dynamiqd (compressed like the default group), or,
where its ranks are not on every node, exact on its inner Gloo group; groups interleaved;
destroy_process_group releasing the group's registration. Workers: pg_worker.py groups."""

import os

import torch

from conftest import HERE, run_workers, worker_envs
from pg_worker import values

WORKER = os.path.join(HERE, "pg_worker.py")
N = 50_000


def run(mode, envs, workdir):
    for code, out in run_workers([WORKER, mode, workdir], envs):
        assert code == 0, out[-4000:]
    ranks = [torch.load(os.path.join(workdir, f"rank{r}.pt")) for r in range(len(envs))]
    for x in ranks:
        assert "error" not in x, x.get("error")
    return ranks


def group_envs(cluster, nodes, per_node, job, groups, **extra):
    return [dict(e, PG_GROUPS=groups, PG_CONTROL=cluster.controls[r // per_node], **extra)
            for r, e in enumerate(worker_envs(cluster, nodes, per_node, job))]


def want(members, seed, average=False):
    total = sum(values(r, N, seed) for r in members)
    return total / len(members) if average else total


def seeds(x, key):
    """The seeds pg_worker's groups mode used for `key`'s SUM and AVG (by its place among the groups)."""
    keys = list(x["info"]) + ["world"]
    i = keys.index(key)
    return 10 + i, 40 + i


def vnmse(got, ref):
    return float(((got.double() - ref.double()) ** 2).sum() / (ref.double() ** 2).sum())


def scale(got, ref):
    """The least-squares factor from ref to got: 1 for an unbiased mean, 3/4 if it divided by 4."""
    return float((got.double() * ref.double()).sum() / (ref.double() ** 2).sum())


def test_groups_on_one_node_are_exact_sub_jobs_and_destroy_releases_them(node, workdir):
    # Codec none: the daemon sums exactly. Two groups of the same ranks (each its own sub-job) and a
    # group of rank 1 alone (the node is the whole cluster, so it too goes to the daemon).
    ranks = run("groups", group_envs(node, 1, 2, "grp", "all;all;1"), workdir)
    jobs = [x["info"]["0:all"]["job"] for x in ranks]
    assert jobs[0] == jobs[1] and jobs[0].startswith("grp/g1."), jobs
    assert ranks[0]["info"]["1:all"]["job"] not in (jobs[0], "grp")
    assert ranks[0]["info"]["2:1"] is None  # torch: rank 0 is not a member
    assert ranks[1]["info"]["2:1"]["global_ranks"] == [1] and ranks[1]["info"]["2:1"]["rank"] == 0
    for r, x in enumerate(ranks):
        for key, info in x["info"].items():
            if info is None:
                continue
            assert info["uses_daemon"], (key, info)
            s, a = seeds(x, key)
            assert torch.equal(x["sum"][key], want(info["global_ranks"], s)), key
            assert torch.equal(x["avg"][key], want(info["global_ranks"], a, average=True)), key
            # Both all-reduces went through the group's sub-job, with its own sequence.
            records = x["records"][key]
            assert [(d["elements"], d["codec"], d["sequence"]) for d in records] == [(N, "none", 0), (N, "none", 1)]
            assert x["exact_collectives"][key] == 0
            assert torch.equal(x["broadcast"][key], torch.full((3,), float(info["global_ranks"][-1])))
            assert x["all_gather"][key].tolist() == [[float(g)] * 2 for g in info["global_ranks"]]
        assert torch.equal(x["sum"]["world"], want([0, 1], seeds(x, "world")[0]))
        # destroy_process_group(first group): registered (both local ranks) before, gone after.
        assert x["jobs_before"].get(jobs[0]) == 2, x["jobs_before"]
        assert jobs[0] not in x["jobs_after"], x["jobs_after"]
        assert "grp" in x["jobs_after"] and ranks[0]["info"]["1:all"]["job"] in x["jobs_after"]
    assert torch.equal(ranks[1]["after_destroy"], values(1, N, 60))  # group [1] still works


def test_groups_across_two_nodes_compress_and_a_one_node_group_runs_on_gloo(cluster, workdir):
    # 2 nodes x 2 ranks (0, 1 on node 0; 2, 3 on node 1), DynamiQ 4-bit between the nodes. Besides
    # all ranks, a pair across the nodes, an uneven group, and a 2 x 2 device mesh: its rows are
    # one node each, its columns span both.
    c = cluster(nodes=2, codec="dynamiq", bits=4, min_compress_elements=0)
    ranks = run("groups", group_envs(c, 2, 2, "grp2", "all;0,3;0,1,2;0,1;2,3;0,2;1,3"), workdir)
    for r, x in enumerate(ranks):
        info = x["info"]
        for key in ("0:all", "1:0,3", "2:0,1,2", "5:0,2", "6:1,3"):
            if info[key] is None:
                assert r not in [int(g) for g in key.split(":")[1].split(",")], (r, key)
                continue
            # Spans both nodes: a sub-job, compressed like the default group.
            assert info[key]["uses_daemon"] and info[key]["job"].startswith("grp2/g"), info[key]
            members = info[key]["global_ranks"]
            s, a = seeds(x, key)
            assert 0 < vnmse(x["sum"][key], want(members, s)) < 0.2, key
            assert 0 < vnmse(x["avg"][key], want(members, a, average=True)) < 0.2, key
            # The mean divides by the group's 3 ranks, though its nodes run 2 and 1 of them.
            assert abs(scale(x["avg"][key], want(members, a, average=True)) - 1) < 0.05, key
            for d in x["records"][key]:
                assert d["codec"] == "dynamiq" and d["wire_bytes"] < N * 4 * 0.15, d
            assert len(x["records"][key]) == 2
            first = ranks[members[0]]
            assert torch.equal(x["sum"][key], first["sum"][key]), key  # every member the same bits
        # The mesh's rows [0, 1] and [2, 3]: on one node only, exact on Gloo.
        for key in ("3:0,1", "4:2,3"):
            if info[key] is None:
                assert (key == "3:0,1") == (r >= 2), (r, key)
                continue
            assert not info[key]["uses_daemon"] and info[key]["job"] is None, info[key]
            members = info[key]["global_ranks"]
            assert members == ([0, 1] if r < 2 else [2, 3])
            s, a = seeds(x, key)
            assert torch.equal(x["sum"][key], want(members, s)), key
            assert torch.equal(x["avg"][key], want(members, a, average=True)), key
            assert x["records"][key] == [] and x["exact_collectives"][key] == 2
        # The first group (all ranks) left both nodes' daemons; the others stayed.
        job = info["0:all"]["job"]
        assert x["jobs_before"].get(job) == 2 and job not in x["jobs_after"], (x["jobs_before"], x["jobs_after"])
        assert x["jobs_after"].get("grp2") == 2
    # The last group, the column [1, 3], still works after the first is destroyed.
    assert "after_destroy" not in ranks[0] and "after_destroy" not in ranks[2]
    assert 0 < vnmse(ranks[1]["after_destroy"], want([1, 3], 60)) < 0.2
    assert torch.equal(ranks[1]["after_destroy"], ranks[3]["after_destroy"])


def test_a_dynamiq_group_under_a_gloo_default_group_says_what_to_use(node, workdir):
    envs = [dict(e, PG_CONTROL=node.control) for e in worker_envs(node, 1, 1, "gg")]
    (x,) = run("group_on_gloo", envs, workdir)
    assert x["group_error"].startswith('dynamiq backend: new_group(backend="dynamiq") needs the default group on '
                                       'the dynamiq backend too'), x["group_error"]
    assert 'use new_group(..., backend="gloo")' in x["group_error"]


def test_a_group_the_daemon_has_no_room_for_fails_at_new_group_naming_gloo(cluster, workdir):
    # --max_jobs=1: the job itself fills the daemon, so the group's sub-job is refused on every rank.
    c = cluster(nodes=1, codec="none", max_jobs=1)
    results = run_workers([WORKER, "groups", workdir], group_envs(c, 1, 2, "full", "all"))
    assert all(code == 0 for code, _ in results), results
    for r in range(2):
        e = torch.load(os.path.join(workdir, f"rank{r}.pt"))["error"]
        assert e.startswith(f"RuntimeError: dynamiq backend: rank {r} cannot register group 1 (ranks [0, 1]) with "
                            "dynamiqd at "), e
        assert "as job 'full/g1." in e and "RESOURCE_EXHAUSTED" in e, e
        assert e.endswith('(a group can run on Gloo instead: new_group(..., backend="gloo"))'), e
