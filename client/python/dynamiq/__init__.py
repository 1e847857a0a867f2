"""dynamiq: compressed gradient all-reduce through the node's dynamiqd.

    import dynamiq, numpy as np
    client = dynamiq.Client()                  # DQ_SOCKET, DQ_JOB, DQ_LOCAL_RANK, DQ_LOCAL_WORLD_SIZE
    buf = client.allocate(1000 * 4)
    grads = buf.numpy(np.float32, 1000)        # shared memory, no copy
    grads[:] = ...
    client.all_reduce(grads, "layer1")         # in place: the sum over every worker of the job
    fut = client.all_reduce_async(grads, "layer1", average=True)
    result = fut.wait()                        # AllReduceResult(sequence, config_epoch, codec, ...)

dynamiq.torch holds the PyTorch DDP communication hook. See docs/python.md.
"""

from ._dynamiq import (  # noqa: F401  (re-exported API)
    AllReduceResult,
    Buffer,
    Client,
    CompressionConfig,
    Control,
    DType,
    Error,
    Future,
    bfloat16,
    float32,
)

__all__ = [
    "AllReduceResult",
    "Buffer",
    "Client",
    "CompressionConfig",
    "Control",
    "DType",
    "Error",
    "Future",
    "bfloat16",
    "float32",
]

__version__ = "0.1.0"
