"""dynamiq (the pybind11 module) against a real dynamiqd: buffers, sync/async all-reduce, errors,
the operator API. Two workers of one node run as two Clients on two threads of this process, which
also shows that blocking calls release the GIL (otherwise the second worker could never submit)."""

import threading

import numpy as np
import pytest

import dynamiq
from conftest import CLIENT_TIMEOUT_SECONDS

THREAD_SECONDS = 60


def concurrently(*fns):
    """Runs each fn on its own thread; returns their results, or raises the first exception."""
    results = [None] * len(fns)
    errors = [None] * len(fns)

    def run(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: B902 -- reported below
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(THREAD_SECONDS)
        assert not t.is_alive(), "a worker thread did not finish"
    return results, errors


def connect(daemon, job, rank, world=2):
    return dynamiq.Client(socket=daemon.socket, job=job, local_rank=rank, local_world_size=world,
                          timeout=CLIENT_TIMEOUT_SECONDS)


def test_views_share_memory_and_all_reduce_sums_in_place(node):
    c = node
    clients = [connect(c, "sum", r) for r in range(2)]
    assert clients[0].num_nodes == 1 and clients[0].config.codec == "none"
    assert clients[0].uses_submission_ring  # the default: no gRPC call per all-reduce
    buffers = [cl.allocate(1000 * 4) for cl in clients]
    assert buffers[0].size >= 4000 and buffers[0].id != 0
    views = [b.numpy(np.float32, 1000) for b in buffers]
    for r, v in enumerate(views):
        v[:] = np.arange(1000, dtype=np.float32) * (r + 1)
    # A second view sees the same bytes: no copy.
    assert buffers[1].numpy(np.float32, 1000)[7] == 14.0

    results, errors = concurrently(lambda: clients[0].all_reduce(views[0], "x"),
                                   lambda: clients[1].all_reduce(buffers[1], "x", count=1000))
    assert errors == [None, None]
    expected = np.arange(1000, dtype=np.float32) * 3
    for v in views:
        np.testing.assert_array_equal(v, expected)
    assert results[0].sequence == results[1].sequence
    assert results[0].codec == "none"

    # average, on a region in the middle of the buffer.
    for v in views:
        v[100:200] = 5.0
    _, errors = concurrently(*[lambda cl=cl, v=v: cl.all_reduce(v[100:200], "mid", average=True)
                               for cl, v in zip(clients, views)])
    assert errors == [None, None]
    np.testing.assert_array_equal(views[0][100:200], 5.0)
    np.testing.assert_array_equal(views[0][:100], expected[:100])  # the rest is untouched
    for cl in clients:
        cl.close()


def test_async_futures_complete_with_the_daemons_report(node):
    c = node
    clients = [connect(c, "async", r) for r in range(2)]
    buffers = [cl.allocate(4 * 256 * 4) for cl in clients]
    views = [b.numpy(np.float32) for b in buffers]
    for r, v in enumerate(views):
        v[:1024] = r + 1.0
    futures = [[cl.all_reduce_async(b, f"t{k}", count=256, offset_bytes=k * 1024) for k in range(4)]
               for cl, b in zip(clients, buffers)]
    reports = [[f.wait() for f in fs] for fs in futures]
    for fs in futures:
        assert all(f.done() for f in fs)
    for v in views:
        np.testing.assert_array_equal(v[:1024], 3.0)
    # Both workers see the same collective sequence numbers, in submission order.
    assert [r.sequence for r in reports[0]] == [r.sequence for r in reports[1]]
    assert [r.sequence for r in reports[0]] == sorted(r.sequence for r in reports[0])
    assert reports[0][0].wire_bytes == 0  # one node: nothing crosses the network
    for cl in clients:
        cl.close()


def test_weighted_all_reduce_divides_by_the_weights_and_reports_what_was_summed(node):
    c = node
    clients = [connect(c, "weights", r) for r in range(2)]
    views = [cl.allocate(64 * 4).numpy(np.float32, 64) for cl in clients]
    views[0][:] = 1.0
    views[1][:] = 5.0
    results, errors = concurrently(lambda: clients[0].all_reduce(views[0], "w", average=True, weight=3),
                                   lambda: clients[1].all_reduce_async(views[1], "w", average=True,
                                                                       weight=1).wait())
    assert errors == [None, None]
    for v in views:
        np.testing.assert_array_equal(v, 2.0)  # (3 * 1 + 1 * 5) / 4
    assert [(r.weight_sum, r.contributors) for r in results] == [(4.0, 2), (4.0, 2)]
    # Not a sample count: refused by the client library, before the daemon is asked.
    with pytest.raises(dynamiq.Error, match="INVALID_ARGUMENT.*finite and >= 0"):
        clients[0].all_reduce(views[0], "w", weight=-1.0)
    # Unweighted: the mean over the workers, reported as their number.
    results, errors = concurrently(*[lambda cl=cl, v=v: cl.all_reduce(v, "w", average=True)
                                     for cl, v in zip(clients, views)])
    assert errors == [None, None]
    assert results[0].weight_sum == 2.0 and results[0].contributors == 2
    for cl in clients:
        cl.close()


def test_bfloat16_travels_as_bfloat16(node):
    c = node
    clients = [connect(c, "bf16", r) for r in range(2)]
    buffers = [cl.allocate(64) for cl in clients]
    bits = [b.numpy("bfloat16", 4) for b in buffers]  # uint16 bits
    assert bits[0].dtype == np.uint16
    for b in bits:
        b[:] = 0x3F80  # 1.0
    _, errors = concurrently(*[lambda cl=cl, b=b: cl.all_reduce(b, "h", dtype=dynamiq.bfloat16)
                               for cl, b in zip(clients, bits)])
    assert errors == [None, None]
    np.testing.assert_array_equal(bits[0], 0x4000)  # 2.0
    for cl in clients:
        cl.close()


def test_release_refuses_while_views_exist(node):
    c = node
    client = dynamiq.Client(socket=c.socket, job="release", timeout=CLIENT_TIMEOUT_SECONDS)
    buf = client.allocate(4096)
    view = buf.numpy(np.float32)
    assert buf.users == 1
    with pytest.raises(BufferError, match="1 array views or pending all-reduces"):
        buf.release()
    view[0] = 1.0  # still mapped
    del view
    buf.release()
    assert not buf.valid
    with pytest.raises(ValueError, match="released"):
        buf.numpy()
    client.close()
    with pytest.raises(ValueError, match="closed"):
        client.allocate(16)


def test_mismatched_sizes_raise_the_daemons_message_naming_both(node):
    c = node
    clients = [connect(c, "mismatch", r) for r in range(2)]
    buffers = [cl.allocate(64) for cl in clients]
    _, errors = concurrently(lambda: clients[0].all_reduce(buffers[0], "grads", count=4),
                             lambda: clients[1].all_reduce(buffers[1], "grads", count=3))
    for e in errors:
        assert isinstance(e, dynamiq.Error), e
        assert e.code == "INVALID_ARGUMENT"
        # The daemon's message, unchanged, names both workers and what each submitted.
        for part in ("local rank 0", "(4 x float32)", "local rank 1", "(3 x float32)"):
            assert part in e.message, e.message
        assert str(e) == f"INVALID_ARGUMENT: {e.message}"
    for cl in clients:
        cl.close()


def test_client_side_errors(node):
    with pytest.raises(dynamiq.Error) as missing:
        dynamiq.Client(socket="/nonexistent/dq.sock", job="x")
    assert missing.value.code == "UNAVAILABLE" and "/nonexistent/dq.sock" in missing.value.message
    assert "ClientOptions" not in missing.value.message, missing.value.message
    # Issue 23.10: errors name the Python arguments, not the C++ fields or dynamiqctl's flags.
    with pytest.raises(dynamiq.Error) as empty:
        dynamiq.Client(socket="/tmp/x.sock", job="")
    assert empty.value.code == "INVALID_ARGUMENT" and "job is empty" in empty.value.message, empty.value.message
    with pytest.raises(dynamiq.Error) as no_token:
        dynamiq.Control("127.0.0.1:1", token_file="/nonexistent/token")
    assert "token_file" in no_token.value.message and "--token_file" not in no_token.value.message, \
        no_token.value.message

    c = node
    client = dynamiq.Client(socket=c.socket, job="args", timeout=CLIENT_TIMEOUT_SECONDS)
    buf = client.allocate(4096)
    with pytest.raises(dynamiq.Error, match="do not fit in buffer") as too_big:
        client.all_reduce(buf, "big", count=buf.size)  # float32: 4x too many
    assert too_big.value.code == "INVALID_ARGUMENT"
    with pytest.raises(TypeError, match="float32 or bfloat16"):
        client.all_reduce(buf, "f64", count=4, dtype="float64")
    with pytest.raises(ValueError, match="not a view of a dynamiq Buffer"):
        client.all_reduce(np.zeros(4, np.float32), "plain")
    with pytest.raises(ValueError, match="needs count"):
        client.all_reduce(buf, "nocount")
    # An argument error completes the future at once.
    fut = client.all_reduce_async(buf, "", count=4)
    assert fut.done()
    with pytest.raises(dynamiq.Error, match="empty tensor name"):
        fut.wait()
    buf.release()
    client.close()


def test_control_status_and_set_compression(node):
    c = node
    client = dynamiq.Client(socket=c.socket, job="ctl", timeout=CLIENT_TIMEOUT_SECONDS)
    control = dynamiq.Control(c.control)
    jobs = {j["job_id"]: j for j in control.status()["jobs"]}
    assert jobs["ctl"]["workers"] == 1 and jobs["ctl"]["config"]["codec"] == "none"

    epoch = control.set_compression("ctl", codec="dynamiq", bits=4)
    assert epoch > client.config_epoch
    buf = client.allocate(4096)
    seen = []
    for k in range(6):  # the change applies at a collective boundary a few collectives ahead
        seen.append(client.all_reduce(buf, "probe", count=1))
    assert seen[0].codec == "none"
    assert seen[-1].codec == "dynamiq" and seen[-1].bits == 4 and seen[-1].config_epoch == epoch
    records = control.flight_recorder("ctl")
    assert [r["tensor_name"] for r in records][-6:] == ["probe"] * 6
    with pytest.raises(dynamiq.Error) as bad:
        control.set_compression("ctl", codec="dynamiq", bits=42)
    assert bad.value.code == "INVALID_ARGUMENT" and "42" in bad.value.message
    # An error budget needs errors measured between nodes: refused on this one-node cluster.
    with pytest.raises(dynamiq.Error) as bad:
        control.set_compression("ctl", target_vnmse=1e-3)
    assert bad.value.code == "FAILED_PRECONDITION" and "two or more nodes" in bad.value.message
    buf.release()
    client.close()


def test_set_compression_puts_a_cluster_job_under_an_error_budget(cluster):
    c = cluster(nodes=2, codec="dynamiq", bits=4)
    clients = [dynamiq.Client(socket=c.sockets[n], job="budget", timeout=CLIENT_TIMEOUT_SECONDS) for n in range(2)]
    buffers = [cl.allocate(4096) for cl in clients]
    control = dynamiq.Control(c.control)
    # An error budget instead of fixed bits (docs/error_budget.md).
    budget = control.set_compression("budget", target_vnmse=1e-3, max_bits=7, sample_rate=0.5)
    for k in range(3):  # the change applies at a collective boundary a few collectives ahead
        _, errors = concurrently(*[lambda cl=cl, b=b: cl.all_reduce(b, "probe", count=1)
                                   for cl, b in zip(clients, buffers)])
        assert errors == [None, None]
    job = {j["job_id"]: j for j in control.status()["jobs"]}["budget"]
    assert int(job["config_epoch"]) == budget
    assert job["config"]["error_budget"] == {"target_vnmse": 1e-3, "min_bits": 3.0, "max_bits": 7.0,
                                             "sample_rate": 0.5}
    assert job["config"]["bits"] == 4  # where the controller starts
    with pytest.raises(dynamiq.Error) as bad:
        control.set_compression("budget", target_vnmse=5)
    assert bad.value.code == "INVALID_ARGUMENT" and "target_vnmse" in bad.value.message
    for b in buffers:
        b.release()
    for cl in clients:
        cl.close()
