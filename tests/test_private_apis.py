"""Every private (or internal) API of torch, submitit, hydra-submitit-launcher and Hydra that the
code relies on, pinned: an upgrade that changes one fails here, naming it, not in a user's job.

Replaced by public equivalents (so not listed): rendezvous_handler_registry._registry (register()
is idempotent for the same creator), torch.distributed.elastic.multiprocessing.api.SignalException
(exported by the package), Enum._value2member_map_, nn.Module._modules (get_submodule).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import pytest


def _fake_store() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        assert dist.get_world_size() == 8
    finally:
        dist.destroy_process_group()


def _foreach_copy() -> None:
    import torch

    dst, src = [torch.zeros(3), torch.zeros(2)], [torch.ones(3), torch.full((2,), 2.0)]
    torch._foreach_copy_(dst, src)
    assert dst[0].tolist() == [1, 1, 1] and dst[1].tolist() == [2, 2]


def _static_tcp_rendezvous() -> None:
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    rdzv = StaticTCPRendezvous("127.0.0.1", 0, 0, 1, "run", 30)
    for attribute in ("_store", "master_port", "run_id", "timeout"):
        assert hasattr(rdzv, attribute), f"StaticTCPRendezvous has no {attribute!r}"


def _job_return_value() -> None:
    from hydra.core.utils import JobReturn, JobStatus

    error = ValueError("boom")
    ret = JobReturn(status=JobStatus.FAILED, _return_value=error)
    assert ret._return_value is error


def _parse_node_list() -> None:
    from submitit.slurm.slurm import _parse_node_list

    assert _parse_node_list("gpu[003-004,010],cpu01") == ["gpu003", "gpu004", "gpu010", "cpu01"]


def _submitit_launcher() -> None:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

    params = list(inspect.signature(BaseSubmititLauncher.__call__).parameters)
    assert params == ["self", "sweep_overrides", "job_dir_key", "job_num", "job_id",
                      "singleton_state"], params
    launcher = BaseSubmititLauncher(partition="debug")
    assert launcher.params == {"partition": "debug"}
    setup = inspect.signature(BaseSubmititLauncher.setup).parameters
    assert {"hydra_context", "task_function", "config"} <= set(setup)
    source = inspect.getsource(BaseSubmititLauncher.setup)
    assert "self.config = config" in source and "self.hydra_context = hydra_context" in source


def _submitit_job_internals() -> None:
    from submitit.core.core import Job
    from submitit.core.utils import pickle_load
    from submitit.slurm.slurm import SlurmJob

    assert callable(pickle_load)
    assert hasattr(SlurmJob, "watcher") and callable(SlurmJob.watcher.is_done)
    assert "mode" in inspect.signature(SlurmJob.watcher.is_done).parameters
    assert callable(Job.task) and hasattr(Job, "num_tasks")


def _hydra_config_loader() -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.singleton import Singleton

    assert callable(ConfigLoaderImpl.load_sweep_config)
    assert callable(ConfigLoaderImpl.get_group_options)
    assert callable(Singleton.get_state)


PINNED: list[tuple[str, str, Callable[[], None]]] = [
    ("torch.testing._internal.distributed.fake_pg.FakeStore", "rlcomm/net/rendezvous.py, benchmarks/scale.py: the fake backend", _fake_store),
    ("torch._foreach_copy_", "rlcomm/weight_transfer.py: packing many tensors in one call", _foreach_copy),
    ("StaticTCPRendezvous._store/master_port/run_id/timeout", "app/launch/local.py: LoopbackRendezvous", _static_tcp_rendezvous),
    ("hydra.core.utils.JobReturn._return_value", "app/sweep/callbacks.py, app/launch/slurm.py: a failed job's error without return_value's stderr print", _job_return_value),
    ("submitit.slurm.slurm._parse_node_list", "app/launch/environment.py: first host of a SLURM node list", _parse_node_list),
    ("BaseSubmititLauncher.__call__/params/config/hydra_context", "app/launch/slurm.py: RlcommLauncher", _submitit_launcher),
    ("submitit Job.task/num_tasks, SlurmJob.watcher.is_done, core.utils.pickle_load", "app/launch/slurm.py: waiting for and reading task results", _submitit_job_internals),
    ("Hydra ConfigLoader.load_sweep_config/get_group_options, Singleton.get_state", "app/launch/slurm.py, app/config/help.py", _hydra_config_loader),
]


@pytest.mark.parametrize(("name", "where", "check"), PINNED, ids=[p[0] for p in PINNED])
def test_private_api_still_behaves_as_the_code_expects(
    name: str, where: str, check: Callable[[], None]
) -> None:
    try:
        check()
    except Exception as err:
        pytest.fail(f"private API changed: {name} (used in {where}): {type(err).__name__}: {err}")
