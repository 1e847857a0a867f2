"""torch's own distributed test suite (DistributedTest._DistTestBase) as pytest collects it, for
torch_suite.py: that script sets BACKEND (gloo or dynamiq), WORLD_SIZE, the expecttest stand-in on
PYTHONPATH and, for dynamiq, DQ_SUITE_SOCKETS (the worker sockets of the daemons, one per node).
Not named test_*.py: python_tests does not collect it.

The ranks are forked from the pytest process (torch 1.13 has only _spawn_processes, whose ranks
import torch anew: 18 minutes for the CPU selection instead of about one).
"""

import os

import torch

# The backend the ranks run, and the one torch's decorators select the tests for (DQ_SUITE_SELECT_AS:
# "gloo" runs gloo's list, object collectives, monitored_barrier and timeouts included, on BACKEND).
RUN_BACKEND = os.environ["BACKEND"]
os.environ["BACKEND"] = os.environ.get("DQ_SUITE_SELECT_AS") or RUN_BACKEND

from torch.testing._internal.distributed import distributed_test  # noqa: E402 -- reads BACKEND
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

if RUN_BACKEND == "dynamiq":
    import dynamiq.torch  # noqa: F401 -- registers the backend, also in the forked ranks


class TestDistBackendWithFork(TestDistBackend, DistributedTest._DistTestBase):

    def setUp(self):
        super().setUp()
        self._start_processes(torch.multiprocessing.get_context("fork").Process)

    @classmethod
    def _run(cls, rank, test_name, file_name, pipe):
        # What the test bodies compare against and init_process_group with.
        distributed_test.BACKEND = RUN_BACKEND
        os.environ["BACKEND"] = RUN_BACKEND
        if RUN_BACKEND == "dynamiq":
            # The ranks fill the nodes in order; every test is its own job (a rank of a failed test
            # may still be registered under the previous one).
            sockets = os.environ["DQ_SUITE_SOCKETS"].split(os.pathsep)
            per_node = int(os.environ["WORLD_SIZE"]) // len(sockets)
            node, local = divmod(rank, per_node)
            os.environ.update(DQ_SOCKET=sockets[node], DQ_LOCAL_RANK=str(local), DQ_LOCAL_WORLD_SIZE=str(per_node),
                              DQ_JOB=f"{test_name}.{os.path.basename(file_name)}")
        super()._run(rank, test_name, file_name, pipe)
