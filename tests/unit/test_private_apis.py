"""Every private (or internal) API of torch, submitit, hydra-submitit-launcher and Hydra that the
code relies on, pinned: an upgrade that changes one fails here, naming it, not in a user's job.

The launch room's own (app/launch/) live in one module, app/launch/private.py; docs/launch.md
says why each is needed, and a test here keeps every other module of the room off them.

Pinned in-process (PINNED) where a call shows it, the files a process holds open among them
(``/proc/<pid>/fd``, how DeathWatch knows a rank); with real processes where only they do, in
tests/integration/test_local_launcher_private_apis.py: the elastic agent's rank processes as
multiprocessing's Process objects of the launcher (``multiprocessing.process._children``, how
app/launch/failures.py: DeathWatch watches its ranks), the forkserver's preload
(app/launch/forkserver.py), the exit handlers ``python -m app`` runs before it ends
(``atexit._run_exitfuncs``), and gloo's wording of a peer that left or fell silent, which the
code matches on (rlcomm/net/gloo_words.py).

Replaced by public equivalents (so not listed): rendezvous_handler_registry._registry (register()
is idempotent for the same creator), torch.distributed.elastic.multiprocessing.api.SignalException
(exported by the package), Enum._value2member_map_, nn.Module._modules (get_submodule).
"""

from __future__ import annotations

import inspect
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from app.launch import private


def _fake_store() -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        assert dist.get_world_size() == 8
    finally:
        dist.destroy_process_group()


def _foreach_copy() -> None:

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
    assert private.parse_node_list("gpu[003-004,010],cpu01") == [
        "gpu003", "gpu004", "gpu010", "cpu01"]


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


# RlcommLauncher.launch re-implements the plugin's launch() (one executor per job shape, jobs
# returned unwaited): it mirrors exactly this body. A new plugin release that changes it fails
# here; then compare the two and carry the change over (sweep dir and mode, the job tuple).
_PLUGIN_LAUNCH_SHA256 = "546875669010f80d"


def _submitit_launch_body() -> None:
    import hashlib

    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import BaseSubmititLauncher

    source = inspect.getsource(BaseSubmititLauncher.launch)
    assert hashlib.sha256(source.encode()).hexdigest()[:16] == _PLUGIN_LAUNCH_SHA256, source
    for step in ('sweep_dir.mkdir(parents=True, exist_ok=True)', 'if "mode" in self.config.hydra.sweep:',
                 '"hydra.sweep.dir",', 'f"job_id_for_{idx}",', "Singleton.get_state(),",
                 "executor.map_array(self, *zip(*job_params))"):
        assert step in source, step


def _submitit_job_internals() -> None:
    from submitit.core.core import Job
    from submitit.core.utils import pickle_load
    from submitit.slurm.slurm import SlurmJob

    assert callable(pickle_load)
    assert hasattr(SlurmJob, "watcher") and callable(SlurmJob.watcher.is_done)
    assert "mode" in inspect.signature(SlurmJob.watcher.is_done).parameters
    assert callable(Job.task) and hasattr(Job, "num_tasks")


def _elastic_hostname() -> None:
    from torch.distributed.elastic.agent.server import api, local_elastic_agent

    assert callable(api._get_fq_hostname)
    assert callable(local_elastic_agent.LocalElasticAgent._get_fq_hostname)
    # The events the agent records after its ranks ended name the host through it.
    assert "_get_fq_hostname()" in inspect.getsource(api.SimpleElasticAgent._construct_event)
    assert "self._get_fq_hostname()" in inspect.getsource(local_elastic_agent.LocalElasticAgent)
    before = (api._get_fq_hostname, local_elastic_agent.LocalElasticAgent._get_fq_hostname)
    try:
        private.name_agent_host("pinned-host")
        assert api._get_fq_hostname() == "pinned-host"
        assert local_elastic_agent.LocalElasticAgent._get_fq_hostname(None) == "pinned-host"  # type: ignore[arg-type]
    finally:
        api._get_fq_hostname = before[0]
        local_elastic_agent.LocalElasticAgent._get_fq_hostname = before[1]  # type: ignore[method-assign]


def _elastic_log_texts() -> None:
    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.multiprocessing import api as worker_api

    # The records app/launch/local.py's filters tell apart, by the words torch logs them with.
    assert private.AGENT_RESTART_TEXT in inspect.getsource(api.SimpleElasticAgent)
    assert f'"{private.WORKER_FAILED_PREFIX}' in inspect.getsource(worker_api)
    restart = logging.LogRecord("a", logging.INFO, "", 0, "[default] Worker group FAILED. 1/1 "
                                "attempts left; will restart worker group", None, None)
    other = logging.LogRecord("a", logging.INFO, "", 0, "[default] Starting worker group",
                              None, None)
    assert private.AgentRestartNotice().filter(restart)
    assert not private.AgentRestartNotice().filter(other)
    failed = logging.LogRecord("a", logging.ERROR, "", 0, "failed (exitcode: 1) local_rank: 0",
                               None, None)
    assert not private.NoWorkerTraceback().filter(failed)


def _open_files() -> None:
    # How DeathWatch knows a rank process: by the log file it holds open.
    path = Path(os.path.realpath(__file__))
    with path.open():
        assert path in list(private.open_files(os.getpid()))
    assert list(private.open_files(2**22 + 1)) == []  # no such process: nothing


def _forkserver_main() -> None:
    from multiprocessing import forkserver

    # in_forkserver_preload looks for forkserver.main's code on the stack: main imports the
    # preload itself (the process test below shows it does, from the forkserver).
    assert "__import__(modname)" in inspect.getsource(forkserver.main)
    assert not private.in_forkserver_preload()


def _forkserver_state() -> None:
    from multiprocessing import connection, forkserver, util

    # fork_forkserver does what ForkServer.ensure_running does up to the spawn, then fills in
    # the state ensure_running reads (the process test: tests/e2e/test_startup.py).
    source = inspect.getsource(forkserver.ForkServer.ensure_running)
    for name in ("_forkserver_address", "_forkserver_alive_fd", "_forkserver_pid",
                 "resource_tracker.ensure_running()", "os.waitpid(self._forkserver_pid"):
        assert name in source, name
    assert list(inspect.signature(forkserver.main).parameters)[:3] == [
        "listener_fd", "alive_r", "preload"]
    assert isinstance(forkserver._forkserver, forkserver.ForkServer)
    assert callable(connection.arbitrary_address) and callable(util.is_abstract_socket_namespace)


def _hydra_config_loader() -> None:
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.singleton import Singleton

    assert callable(ConfigLoaderImpl.load_sweep_config)
    assert callable(ConfigLoaderImpl.get_group_options)
    assert callable(Singleton.get_state)


def _hydra_defaults_provenance() -> None:
    from hydra._internal.defaults_list import DefaultsList, Overrides
    from hydra.core.config_loader import ConfigLoader
    from hydra.core.default_element import ResultDefault

    params = list(inspect.signature(ConfigLoader.compute_defaults_list).parameters)
    assert params == ["self", "config_name", "overrides", "run_mode"], params
    assert {"defaults", "overrides"} <= set(DefaultsList.__dataclass_fields__)
    assert {"override_choices", "override_metadata"} <= set(Overrides.__annotations__)
    source = inspect.getsource(Overrides)
    assert "OverrideMetadata(external_override=True)" in source
    assert "containing_config_path=parent_config_path" in source
    assert {"config_path", "parent"} <= set(ResultDefault.__dataclass_fields__)


def _basic_launcher() -> None:
    from hydra._internal.core_plugins.basic_launcher import BasicLauncher

    params = list(inspect.signature(BasicLauncher.launch).parameters)
    assert params == ["self", "job_overrides", "initial_job_idx"], params
    source = inspect.getsource(BasicLauncher.setup)
    assert "self.config = config" in source and "self.hydra_context = hydra_context" in source


def _composable_replicate() -> None:
    from torch.distributed._composable.replicate_with_fsdp import replicate

    # Data parallelism over DTensor (tensor-parallel) parameters; its numbers are checked
    # against DDP's by tests/integration/test_sharding.py.
    assert "mesh" in inspect.signature(replicate).parameters


def _queue_callback() -> None:
    from torch.autograd import Variable

    weight = torch.ones(2, requires_grad=True)
    ran: list[list[float]] = []

    def queue(param: torch.Tensor) -> None:  # at the end of the pass: the gradient is whole
        Variable._execution_engine.queue_callback(lambda: ran.append(param.grad.tolist()))

    weight.register_post_accumulate_grad_hook(queue)
    (weight * torch.tensor([3.0, 4.0])).sum().backward()
    assert ran == [[3.0, 4.0]], ran


def _hydra_run_and_report() -> None:
    from hydra import main
    from hydra._internal import utils

    assert "run_and_report(" in inspect.getsource(utils._run_hydra)
    assert "_run_hydra(" in inspect.getsource(main)
    assert list(inspect.signature(utils.run_and_report).parameters) == ["func"]


PINNED: list[tuple[str, str, Callable[[], None]]] = [
    ("torch.testing._internal.distributed.fake_pg.FakeStore", "rlcomm/net/rendezvous.py, benchmarks/scale.py: the fake backend", _fake_store),
    ("torch._foreach_copy_", "rlcomm/weights/buffers.py: packing many tensors in one call", _foreach_copy),
    ("StaticTCPRendezvous._store/master_port/run_id/timeout", "app/launch/local.py: LoopbackRendezvous", _static_tcp_rendezvous),
    ("hydra.core.utils.JobReturn._return_value", "app/hydra/sweep_summary.py, app/hydra/submitit.py: a failed job's error without return_value's stderr print", _job_return_value),
    ("submitit.slurm.slurm._parse_node_list", "app/launch/private.py: parse_node_list (environment.py: first host of a SLURM node list)", _parse_node_list),
    ("BaseSubmititLauncher.__call__/params/config/hydra_context", "app/hydra/submitit.py: RlcommLauncher", _submitit_launcher),
    ("BaseSubmititLauncher.launch (its body)", "app/hydra/submitit.py: RlcommLauncher.launch mirrors it", _submitit_launch_body),
    ("submitit Job.task/num_tasks, SlurmJob.watcher.is_done, core.utils.pickle_load", "app/hydra/submitit.py: waiting for and reading task results", _submitit_job_internals),
    ("Hydra ConfigLoader.load_sweep_config/get_group_options, Singleton.get_state", "app/hydra/submitit.py, app/hydra/sweep_jobs.py, app/config/help.py", _hydra_config_loader),
    ("Hydra ConfigLoader.compute_defaults_list: DefaultsList.overrides.override_metadata", "app/config/provenance.py: whose choice a layout was", _hydra_defaults_provenance),
    ("hydra._internal.core_plugins.basic_launcher.BasicLauncher (launch, setup)", "app/hydra/sweep_jobs.py: RlcommBasicLauncher", _basic_launcher),
    ("torch elastic _get_fq_hostname (api, LocalElasticAgent)", "app/launch/private.py: name_agent_host", _elastic_hostname),
    ("torch elastic's log texts (restart notice, worker failed)", "app/launch/private.py: AgentRestartNotice, NoWorkerTraceback", _elastic_log_texts),
    ("/proc/<pid>/fd links", "app/launch/private.py: open_files (DeathWatch)", _open_files),
    ("multiprocessing.forkserver.main imports the preload", "app/launch/private.py: in_forkserver_preload", _forkserver_main),
    ("multiprocessing.forkserver's state and main", "app/launch/private.py: fork_forkserver", _forkserver_state),
    ("torch.distributed._composable.replicate_with_fsdp.replicate", "app/runtime/trainer/trained.py: DDP over a tensor-parallel policy", _composable_replicate),
    ("torch.autograd.Variable._execution_engine.queue_callback", "app/runtime/trainer/gradients.py: gradients averaged at a backward pass's end", _queue_callback),
    ("hydra._internal.utils.run_and_report", "app/launch/private.py: one_line_override_errors", _hydra_run_and_report),
]


@pytest.mark.unit
@pytest.mark.parametrize(("name", "where", "check"), PINNED, ids=[p[0] for p in PINNED])
def test_private_api_still_behaves_as_the_code_expects(
    name: str, where: str, check: Callable[[], None]
) -> None:
    try:
        check()
    except Exception as err:
        pytest.fail(f"private API changed: {name} (used in {where}): {type(err).__name__}: {err}")


# What reaches into torch's, Python's or submitit's internals: in the launch room only
# app/launch/private.py may (subclass hooks aside: LoopbackRendezvous; the Hydra adapters'
# RlcommLauncher and RlcommBasicLauncher live in app/hydra/).
_PRIVATE_USES = {
    "multiprocessing.process._children": r"process\._children",
    "readlink of /proc/<pid>/fd": r"os\.readlink|/fd\b",
    "torch elastic's _get_fq_hostname": r"_get_fq_hostname",
    "frame walking": r"sys\._getframe|currentframe|f_back",
    "torch elastic's log texts": r"will restart worker group|failed \(exitcode",
    "submitit's _parse_node_list": r"_parse_node_list",
    "multiprocessing.forkserver's state": r"_forkserver_(pid|address|alive_fd)\b|forkserver\.main\(",
}


@pytest.mark.unit
def test_the_launch_rooms_private_apis_live_in_one_module() -> None:
    room = Path(__file__).resolve().parents[2] / "app" / "launch"
    found = [
        f"{path.name}:{number}: {what}"
        for path in sorted(room.glob("*.py")) if path.name != "private.py"
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        for what, pattern in _PRIVATE_USES.items() if re.search(pattern, line)
    ]
    assert not found, "use app/launch/private.py instead:\n" + "\n".join(found)
    source = (room / "private.py").read_text()
    assert all(re.search(pattern, source) for pattern in _PRIVATE_USES.values())
