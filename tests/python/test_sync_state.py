"""dynamiq.torch.sync_state: a joining worker gets the members' state, bit for bit, whatever the
job's codec (here DynamiQ 4 bits on every tensor, which no lossy all-reduce could carry exactly)."""

import pytest
import torch

import dynamiq
import dynamiq.torch
from conftest import CLIENT_TIMEOUT_SECONDS
from test_client import concurrently


def _clients(c, job):
    return [dynamiq.Client(socket=c.sockets[r // 2], job=job, local_rank=r % 2, local_world_size=2,
                           timeout=CLIENT_TIMEOUT_SECONDS) for r in range(4)]


def _state(seed):
    g = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn(33, 17, generator=g), "layer.bias": torch.randn(17, generator=g).bfloat16(),
            "step": torch.tensor([seed], dtype=torch.int64)}


def test_the_members_state_reaches_a_joiner_bit_for_bit_and_a_second_sync_copies_nothing(cluster):
    c = cluster(nodes=2, codec="dynamiq", bits=4, min_compress_elements=1)
    clients = _clients(c, "sync")
    states = [_state(0)] + [_state(1) for _ in range(3)]  # rank 0 joined with another state
    results, errors = concurrently(*[lambda c=cl, s=s, r=r: dynamiq.torch.sync_state(s, rank=r, world=4, client=c)
                                     for r, (cl, s) in enumerate(zip(clients, states))])
    assert errors == [None] * 4
    assert [r["copied"] for r in results] == [True, False, False, False]
    assert {(r["source"], r["agreeing"]) for r in results} == {(1, 3)}
    want = _state(1)
    for s in states:
        for key, t in want.items():
            assert s[key].dtype == t.dtype and torch.equal(s[key], t), key
    again, errors = concurrently(*[lambda c=cl, s=s, r=r: dynamiq.torch.sync_state(s, rank=r, world=4, client=c)
                                   for r, (cl, s) in enumerate(zip(clients, states))])
    assert errors == [None] * 4
    assert [r["copied"] for r in again] == [False] * 4 and {r["agreeing"] for r in again} == {4}
    for client in clients:
        client.close()


def test_other_shapes_are_refused_on_every_worker_and_nothing_is_copied(cluster):
    c = cluster(nodes=2, codec="none")
    clients = _clients(c, "shapes")
    states = [_state(1) for _ in range(4)]
    states[2]["layer.bias"] = torch.zeros(18)
    before = [{k: t.clone() for k, t in s.items()} for s in states]
    _, errors = concurrently(*[lambda c=cl, s=s, r=r: dynamiq.torch.sync_state(s, rank=r, world=4, client=c)
                               for r, (cl, s) in enumerate(zip(clients, states))])
    assert all(isinstance(e, ValueError) and "1 of 4 workers hold other tensors" in str(e) for e in errors), errors
    for s, b in zip(states, before):
        assert all(torch.equal(s[k], b[k]) for k in s)
    with pytest.raises(ValueError, match="rank and world"):
        dynamiq.torch.sync_state(states[0], client=clients[0])
    for client in clients:
        client.close()
