"""Sharded checkpoints (app/runtime/checkpoints/checkpoint.py, docs/sharding.md): each trainer writes its
own shards with torch.distributed.checkpoint, a checkpoint reshards into another grid (DDP
too), one process reads the whole policy without a process group, and every promise of a
checkpoint holds for the folder form (checksums, a corrupt newest one skipped and named, named
write errors, stale ``.tmp`` folders removed).

Real ranks over gloo (rlcomm.testing.run_ranks) write and read each checkpoint; the trained
state is a transformer after one Adam step with a fixed gradient, so every grid computes the
same weights and optimizer state.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from app.api import ConfigError
from app.launch.failures import write_error_line
from app.runtime.checkpoints.agreement import policy_shapes, resume_mismatch
from app.runtime.checkpoints.checkpoint import (
    STATE_FILE,
    TrainingState,
    file_digest,
    find_checkpoint,
    last_checkpoint_note,
    load_checkpoint,
    newest_valid_checkpoint,
)
from app.runtime.checkpoints.policy import load_policy_state
from app.runtime.checkpoints.shards import load_sharded_checkpoint, save_sharded_checkpoint
from app.runtime.envs.vector import EnvConfig, probe_spaces
from app.runtime.models.transformer import TransformerActorCritic
from app.runtime.trainer.trained import TrainedModule
from rlcomm import CommContext, LayoutSpec, ParallelMode, plan_layout
from rlcomm.testing import run_ranks
from tests.helpers.shapes import shape_of

pytestmark = pytest.mark.integration

ENV = EnvConfig(id="MaskedCartPole-v1", _target_="app.runtime.envs.memory.masked_cartpole")
MODEL = {"width": 128, "layers": 2, "heads": 4, "context": 4}
GRIDS = {"ddp4": ("ddp", None), "fsdp4": ("fsdp", None), "tp2-fsdp2": ("fsdp", 2),
         "tp2-ddp2": ("ddp", 2)}
TIMEOUT_S = 300  # generous: the machine's two cores are shared


def _trainer(rank: int, world: int, grid: str) -> tuple[CommContext, TrainedModule,
                                                        torch.optim.Optimizer]:
    data_parallel, tensor = GRIDS[grid]
    plan = plan_layout(LayoutSpec(world_size=world, trainers=list(range(world)),
                                  tensor_parallel_size=tensor))
    ctx = CommContext()
    ctx.init_distributed_env(backend="gloo", timeout=120)
    ctx.init_groups(plan)
    torch.manual_seed(0)
    net = TransformerActorCritic(probe_spaces(ENV), **MODEL)
    trained = TrainedModule(ctx, plan, net, shape_of(plan, data_parallel))
    return ctx, trained, torch.optim.Adam(trained.parameters(), lr=1e-2)


def _whole(trained: TrainedModule, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The policy and the optimizer's moments, whole (gathered here only to compare), as numpy
    arrays (a tensor would cross to the test process as shared memory of a rank that ended)."""
    policy, optim = trained.state_dicts(optimizer)
    if not any(isinstance(k, str) for k in optim["state"]):  # DDP's: by index
        names = [n for n, _ in trained.net.named_parameters()]
        optim = {"state": {names[i]: v for i, v in optim["state"].items()}}
    return {"policy": {k: v.numpy().copy() for k, v in policy.items()},
            "moments": {f"{name}/{key}": value.numpy().copy()
                        for name, entry in optim["state"].items()
                        for key, value in entry.items() if key != "step"}}


def _write(rank: int, world: int, grid: str, run_dir: Path, update: int,
           whole: bool = True) -> dict[str, Any]:
    """One Adam step of a fixed gradient on ``grid``, then the sharded checkpoint of it."""
    ctx, trained, optimizer = _trainer(rank, world, grid)
    try:
        for param in trained.parameters():
            param.grad = torch.full_like(param, 0.5)
        optimizer.step()
        trained.publish()
        group = ctx.get_group(ParallelMode.TRAIN_DATA_PARALLEL)
        state = TrainingState(update, 512 * update, [(10.0, 10)],
                              settings={"loop.model.width": MODEL["width"]},
                              normalizers={"obs_moments": torch.arange(3.0)})
        path = save_sharded_checkpoint(run_dir, trained, optimizer, group, state)
        return {"path": path, **(_whole(trained, optimizer) if whole else {})}
    finally:
        ctx.destroy()


def _read(rank: int, world: int, grid: str, path: Path) -> dict[str, Any]:
    """A fresh ``grid`` of trainers resumed from ``path``: what it holds, whole."""
    ctx, trained, optimizer = _trainer(rank, world, grid)
    try:
        load_sharded_checkpoint(path, trained, optimizer,
                                ctx.get_group(ParallelMode.TRAIN_DATA_PARALLEL))
        acting = {k: v.numpy().copy() for k, v in trained.net.state_dict().items()}
        return {"acting": acting, **_whole(trained, optimizer)}
    finally:
        ctx.destroy()


def _try_write(rank: int, world: int, run_dir: Path, failing: int | None) -> str:
    """Update 2's checkpoint, rank ``failing``'s disk full when it writes its shard file: what
    each rank saw."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    if rank == failing:
        def full(self: Any, path: Any, mode: str) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))

        FileSystem.create_stream = full  # type: ignore[method-assign]
    try:
        _write(rank, world, "fsdp4", run_dir, 2, whole=False)
    except OSError as err:  # as the launcher's error line would say it, else the error itself
        return write_error_line(err) or f"{type(err).__name__} {err.filename} {err.__notes__}"
    return "returned"


def _assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        torch.testing.assert_close(torch.as_tensor(a[name]), torch.as_tensor(b[name]),
                                   rtol=1e-6, atol=1e-7, msg=name)


@pytest.fixture(scope="module")
def fsdp4(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, Any]]:
    """Two checkpoints of a transformer trained FSDP over 4 trainers; the ranks' results."""
    run_dir = tmp_path_factory.mktemp("fsdp4")
    run_ranks(_write, 4, "fsdp4", run_dir, 1, timeout=TIMEOUT_S)
    return run_dir, run_ranks(_write, 4, "fsdp4", run_dir, 2, timeout=TIMEOUT_S)


def test_each_fsdp_trainer_writes_its_own_quarter_and_rank_0_the_rest(
    fsdp4: tuple[Path, dict[int, Any]],
) -> None:
    run_dir, results = fsdp4
    folder = run_dir / "checkpoints" / "ckpt_000002"
    assert results[0]["path"] == folder and all(results[r]["path"] is None for r in (1, 2, 3))
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "ckpt_000001", "ckpt_000002"]
    names = sorted(p.name for p in folder.iterdir())
    assert names == [".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp",
                     "__3_0.distcp", STATE_FILE]
    # The policy and Adam's two moments: three times the parameters' bytes, a quarter each.
    whole = 3 * sum(t.nbytes for t in results[0]["policy"].values())
    sizes = [(folder / f"__{r}_0.distcp").stat().st_size for r in range(4)]
    assert sum(sizes) >= whole
    for size in sizes:  # nobody wrote the whole model: about a quarter each (DCP adds about
        assert 0.2 * whole < size < 0.3 * whole, (sizes, whole)  # 1.6 kB per tensor)
    # Tensor by tensor (DCP's .metadata says which file holds which piece): each one of four
    # rows or more is in four pieces of a quarter, one in each trainer's file.
    metadata = FileSystemReader(folder).read_metadata()
    pieces: dict[str, list[tuple[str, int]]] = {}
    for index, where in metadata.storage_data.items():
        meta = metadata.state_dict_metadata[index.fqn]
        if isinstance(meta, TensorStorageMetadata) and len(meta.size) and meta.size[0] >= 4:
            chunk = next(c for c in meta.chunks if c.offsets == index.offset)
            pieces.setdefault(index.fqn, []).append((where.relative_path, chunk.sizes.numel()))
    rows = [t.shape[0] for t in results[0]["policy"].values() if t.ndim]
    assert len(pieces) == 3 * sum(n >= 4 for n in rows) > 60  # the heads have 1 or 2 rows
    for key, parts in pieces.items():
        total = metadata.state_dict_metadata[key].size.numel()  # type: ignore[union-attr]
        assert sorted(parts) == [(f"__{r}_0.distcp", total // 4) for r in range(4)], key
    # Rank 0's state.pt: no tensor of the policy, a manifest of every other file.
    state = load_checkpoint(folder)
    assert "policy" not in state and "optimizer" not in state
    assert state["update"] == 2 and state["env_steps"] == 1024 and state["format"] == 4
    assert state["policy_shapes"]["layers.0.attention.wq.weight"] == [128, 128]
    assert (folder / STATE_FILE).stat().st_size < min(sizes)
    assert sorted(state["files"]) == names[:-1]
    for name, (digest, size) in state["files"].items():
        assert (digest, size) == (file_digest(folder / name), (folder / name).stat().st_size)
    torch.testing.assert_close(state["normalizers"]["obs_moments"], torch.arange(3.0))
    # The check before launch, from state.pt alone: the settings, then the whole shapes.
    shapes = policy_shapes(TransformerActorCritic(probe_spaces(ENV), **MODEL))
    assert resume_mismatch(state, {"loop.model.width": 128}, shapes) is None
    assert resume_mismatch(state, {"loop.model.width": 64}, shapes) == (
        "loop.resume: checkpoint has loop.model.width=128, this run 64")
    narrow = policy_shapes(TransformerActorCritic(probe_spaces(ENV), **{**MODEL, "width": 64}))
    assert resume_mismatch(state, {}, narrow) == (
        "loop.resume: checkpoint has policy tensor embed.weight of shape [128, 3], this run "
        "[64, 3]")


@pytest.mark.parametrize("grid", ["ddp4", "tp2-fsdp2", "fsdp4"])
def test_an_fsdp4_checkpoint_resumes_on_another_grid_with_the_same_state(
    fsdp4: tuple[Path, dict[int, Any]], grid: str,
) -> None:
    run_dir, written = fsdp4
    read = run_ranks(_read, 4, grid, run_dir / "checkpoints" / "ckpt_000002", timeout=TIMEOUT_S)
    for rank in range(4):
        _assert_same(read[rank]["acting"], written[0]["policy"])  # what the rollouts get
        _assert_same(read[rank]["policy"], written[0]["policy"])
        _assert_same(read[rank]["moments"], written[0]["moments"])


def test_a_tp2_x_fsdp2_checkpoint_resumes_under_ddp(tmp_path: Path) -> None:
    written = run_ranks(_write, 4, "tp2-fsdp2", tmp_path, 3, timeout=TIMEOUT_S)
    folder = tmp_path / "checkpoints" / "ckpt_000003"
    read = run_ranks(_read, 4, "ddp4", folder, timeout=TIMEOUT_S)
    for rank in range(4):
        _assert_same(read[rank]["policy"], written[0]["policy"])
        _assert_same(read[rank]["moments"], written[0]["moments"])


def test_one_process_reads_the_whole_policy_without_a_process_group(
    fsdp4: tuple[Path, dict[int, Any]],
) -> None:
    run_dir, written = fsdp4
    assert not torch.distributed.is_initialized()
    for where in (run_dir, run_dir / "checkpoints", run_dir / "checkpoints" / "ckpt_000002"):
        _assert_same(load_policy_state(where), written[0]["policy"])
    net = TransformerActorCritic(probe_spaces(ENV), **MODEL)
    net.load_state_dict(load_policy_state(run_dir))  # every tensor, whole


def test_a_corrupt_or_incomplete_shard_skips_the_newest_checkpoint_naming_it(
    fsdp4: tuple[Path, dict[int, Any]], tmp_path: Path,
) -> None:
    source, _ = fsdp4
    shutil.copytree(source / "checkpoints", tmp_path / "checkpoints")
    newest = tmp_path / "checkpoints" / "ckpt_000002"
    assert find_checkpoint(newest) == newest and find_checkpoint(tmp_path) == newest
    shard = newest / "__1_0.distcp"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 1  # one bit of one shard: its size unchanged
    shard.write_bytes(bytes(raw))
    picked = newest_valid_checkpoint(tmp_path)
    assert picked.path.name == "ckpt_000001" and picked.sharded
    assert picked.notes() == [f"loop.resume: skipped {newest}: corrupt (__1_0.distcp does not "
                              "match its checksum); resuming from ckpt_000001"]
    # Named explicitly, it is refused; the policy is not read from it either.
    with pytest.raises(ConfigError) as err:
        load_policy_state(newest)
    assert str(err.value) == (f"loop.resume: {str(newest)!r} is corrupt (__1_0.distcp does "
                              "not match its checksum)")
    # A rank that only needs to know where the run resumed checks sizes, reads no shard.
    assert newest_valid_checkpoint(tmp_path, shards=False).path == newest
    # A missing shard, or no state.pt (its manifest), is skipped alike.
    shard.unlink()
    assert newest_valid_checkpoint(tmp_path, shards=False).skipped == [
        (newest, "incomplete (its __1_0.distcp is missing)")]
    shutil.rmtree(newest)
    newest.mkdir()
    assert newest_valid_checkpoint(tmp_path).skipped == [
        (newest, f"not a complete checkpoint (no {STATE_FILE}, its manifest)")]
    assert last_checkpoint_note(tmp_path / "checkpoints") == "the last checkpoint is ckpt_000002"


def test_a_failed_shard_write_names_the_file_and_the_last_checkpoint(tmp_path: Path) -> None:
    run_ranks(_write, 4, "fsdp4", tmp_path, 1, timeout=TIMEOUT_S)
    folder = tmp_path / "checkpoints"
    for stale in ("ckpt_000002.tmp", "ckpt_000007.tmp"):  # left by ranks killed mid-write
        (folder / stale).mkdir()
        (folder / stale / "__0_0.distcp").write_bytes(b"half")
    seen = run_ranks(_try_write, 4, tmp_path, 2, timeout=TIMEOUT_S)
    # The rank whose write failed names the shard file by the checkpoint's final name, and
    # the last complete checkpoint; the others write nothing and leave it to end the run.
    assert seen == {0: "returned", 1: "returned",
                    2: f"no space left on device writing {folder}/ckpt_000002/__2_0.distcp; "
                       "the last checkpoint is ckpt_000001",
                    3: "returned"}
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt_000001"]
    # Renaming onto something in the way fails on rank 0, naming the checkpoint.
    (folder / "ckpt_000002").write_text("in the way")
    seen = run_ranks(_try_write, 4, tmp_path, None, timeout=TIMEOUT_S)
    assert seen[0] == (f"NotADirectoryError {folder}/ckpt_000002 "
                       "['the last checkpoint is ckpt_000001']")
    assert sorted(p.name for p in folder.iterdir()) == ["ckpt_000001", "ckpt_000002"]
