"""sync_state: the members' state for a worker that joins a running job (dynamiq.torch re-exports it).

A restarted node rejoins its job where the others went on (docs/operations.md, "Nodes that leave"),
but its worker starts from whatever it loaded. Before it trains on, every worker calls
sync_state(model.state_dict()) (and the optimizer's, and a tensor holding the step) at the same
point: the state most workers hold is copied bit for bit to those whose state differs.
"""

import hashlib

import numpy as np
import torch
import torch.distributed as dist

import dynamiq


def _tensors(state):
    if isinstance(state, torch.Tensor):
        return [("", state)]
    if isinstance(state, dict):
        return [(str(k), v) for k, v in sorted(state.items(), key=lambda kv: str(kv[0])) if isinstance(v, torch.Tensor)]
    return [(str(i), t) for i, t in enumerate(state)]


def sync_state(state, *, rank=None, world=None, client=None, name="state"):
    """Makes `state` (a tensor, a list of tensors, or a dict such as a state_dict(): its tensors, by
    key) identical on every worker of the job, in place, and returns
    {"copied", "source", "agreeing", "hash"} (dynamiq.Client.sync_state).

    Every worker calls it with the same tensors (names, shapes, dtypes) at the same point of its
    collectives. The shapes are compared first: when any worker's differ, every worker raises
    ValueError and nothing is copied. Then the bytes most workers hold (a tie: the lowest rank's)
    go bit for bit to the workers whose bytes differ, uncompressed whatever the job's codec; when
    all agree nothing more is sent (idempotent). Each all-reduce is bounded by the client's timeout.

    rank, world: this worker's place among the job's workers; default torch.distributed's
    (initialized with any backend). client: default, one dynamiq.Client from the DQ_* environment.
    It uses the state's size in shared memory while it runs, plus 64 MiB while bytes are copied
    (32 MiB of state per all-reduce), and the state's size again on a worker that receives it."""
    if rank is None or world is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("sync_state needs rank and world (or an initialized torch.distributed)")
        rank = dist.get_rank() if rank is None else rank
        world = dist.get_world_size() if world is None else world
    if client is None:
        from dynamiq import torch as dqt  # the process's default client

        with dqt._default_lock:
            if dqt._default_client is None:
                dqt._default_client = dynamiq.Client()
            client = dqt._default_client
    items = _tensors(state)
    if not items:
        raise ValueError("sync_state of no tensors")
    # 1. The layout (names, shapes and dtypes), which every worker must share: its SHA-256.
    layout = hashlib.sha256(";".join(f"{k}:{tuple(t.shape)}:{t.dtype}" for k, t in items).encode()).digest()
    buf = client.allocate(len(layout))
    try:
        buf.numpy(dtype="uint8", count=len(layout))[:] = np.frombuffer(layout, dtype=np.uint8)
        shapes = client.sync_state(buf, len(layout), rank=rank, world=world, name=f"{name}/layout")
    finally:
        buf.release()
    if shapes["agreeing"] != world:
        raise ValueError(
            f"sync_state '{name}': {world - shapes['agreeing']} of {world} workers hold other tensors "
            f"(names, shapes or dtypes) than the others; nothing was copied")
    # 2. The bytes.
    sizes = [t.numel() * t.element_size() for _, t in items]
    total = sum(sizes)
    if total == 0:
        return shapes
    buf = client.allocate(total)
    try:
        flat = torch.from_numpy(buf.numpy(dtype="uint8", count=total))
        offset = 0
        for (_, t), n in zip(items, sizes):
            flat[offset:offset + n].copy_(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8))
            offset += n
        result = client.sync_state(buf, total, rank=rank, world=world, name=f"{name}/bytes")
        if result["copied"]:
            offset = 0
            with torch.no_grad():
                for (_, t), n in zip(items, sizes):
                    # clone(): a tensor's bytes may start unaligned for its dtype in the buffer.
                    t.copy_(flat[offset:offset + n].clone().view(t.dtype).reshape(t.shape))
                    offset += n
    finally:
        del flat
        buf.release()
    return result
