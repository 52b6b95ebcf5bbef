"""A resume is checked before launch, and checkpoints prove themselves (docs/data-safety.md).

These tests work on real ``torch.save`` files written by ``save_checkpoint``, in this process;
tests/e2e/test_resume.py resumes real runs through ``python -m app``.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from app.api import ConfigError
from app.loops.ppo import PPOLoop
from app.loops.ppo.core import PPOSettings, make_optimizer
from app.runtime.checkpoints.agreement import (
    policy_shapes,
    resume_mismatch,
    run_settings,
)
from app.runtime.checkpoints.checkpoint import (
    TrainingState,
    load_checkpoint,
    newest_valid_checkpoint,
    save_checkpoint,
)


def _loop(**hparams: Any) -> PPOLoop:
    return PPOLoop(hparams=dataclasses.replace(PPOSettings(), **hparams))


def _save(run_dir: Path, update: int, loop: PPOLoop | None = None) -> Path:
    """A real checkpoint of a fresh policy, as rank 0 writes it."""
    loop = loop or _loop()
    policy = loop.build_algorithm(loop.spaces).build()
    state = TrainingState(update, update * 256, [(10.0, 10)],
                          settings=run_settings(loop, loop.spaces))
    return save_checkpoint(run_dir, policy, make_optimizer(policy, loop.hparams), state)


def _mismatch(state: dict[str, Any], loop: PPOLoop) -> str | None:
    policy = loop.build_algorithm(loop.spaces).build()
    return resume_mismatch(state, run_settings(loop, loop.spaces), policy_shapes(policy))


# ---- unit: checksums, the choice of checkpoint, what must agree ------------------------------


@pytest.mark.unit
def test_a_checkpoint_carries_a_checksum_and_a_changed_byte_is_named_corrupt(tmp_path: Path) -> None:
    path = _save(tmp_path, 2)
    state = load_checkpoint(path)
    assert re.fullmatch(r"[0-9a-f]{64}", state["checksum"])
    assert state["settings"]["loop.hparams.hidden_size"] == 64
    # One bit of one weight flipped inside the file: torch still reads it, the checksum does not.
    raw = bytearray(path.read_bytes())
    weight = state["policy"]["actor.0.weight"].numpy().tobytes()
    at = raw.find(weight)
    assert at > 0 and raw.find(weight, at + 1) == -1
    raw[at + 5] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ConfigError) as err:
        load_checkpoint(path)
    assert str(err.value) == (f"loop.resume: {str(path)!r} is corrupt "
                              "(its content does not match its checksum)")


@pytest.mark.unit
def test_a_truncated_newest_checkpoint_is_skipped_for_the_newest_valid_one(tmp_path: Path) -> None:
    for update in (1, 2, 3):
        _save(tmp_path, update)
    newest = tmp_path / "checkpoints" / "ckpt_000003.pt"
    newest.write_bytes(newest.read_bytes()[:1000])  # a write cut short
    picked = newest_valid_checkpoint(tmp_path)
    assert picked.path.name == "ckpt_000002.pt" and picked.state["update"] == 2
    assert [(p.name, why.split(" (")[0]) for p, why in picked.skipped] == [
        ("ckpt_000003.pt", "not a readable checkpoint")]
    (note,) = picked.notes()
    assert note.startswith(f"loop.resume: skipped {newest}: not a readable checkpoint (truncated")
    assert note.endswith("; resuming from ckpt_000002.pt")
    # Named explicitly, a broken file is refused, never replaced by another.
    with pytest.raises(ConfigError, match=r"is not a readable checkpoint \(truncated or corrupt"):
        newest_valid_checkpoint(newest)


@pytest.mark.unit
def test_a_folder_of_only_broken_checkpoints_is_refused_naming_each(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    only = tmp_path / "checkpoints" / "ckpt_000001.pt"
    only.write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        newest_valid_checkpoint(tmp_path)
    assert str(err.value).startswith(
        f"loop.resume: {str(tmp_path)!r} holds no valid checkpoint: ckpt_000001.pt is not a "
        "readable checkpoint")


@pytest.mark.unit
def test_stale_tmp_files_are_ignored_on_resume_and_removed_by_the_next_write(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    stale = tmp_path / "checkpoints" / "ckpt_000002.tmp"
    stale.write_bytes(b"half a checkpoint")
    assert newest_valid_checkpoint(tmp_path).path.name == "ckpt_000001.pt"
    _save(tmp_path, 2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "ckpt_000001.pt", "ckpt_000002.pt"]


@pytest.mark.unit
def test_a_failed_write_leaves_no_tmp_and_names_the_last_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 1)
    in_the_way = tmp_path / "checkpoints" / "ckpt_000002.pt"
    in_the_way.mkdir()  # the rename onto it fails: a real OSError after the data was written
    (in_the_way / "x").write_text("x")
    with pytest.raises(OSError) as err:
        _save(tmp_path, 2)
    assert err.value.__notes__ == ["the last checkpoint is ckpt_000001.pt"]
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    assert newest_valid_checkpoint(tmp_path).path.name == "ckpt_000001.pt"
    # With no complete checkpoint yet, the note says so.
    fresh = tmp_path / "fresh"
    (fresh / "checkpoints" / "ckpt_000001.pt" / "x").mkdir(parents=True)
    with pytest.raises(OSError) as err:
        _save(fresh, 1)
    assert err.value.__notes__ == ["no checkpoint was written before"]
    assert not list((fresh / "checkpoints").glob("*.tmp"))


@pytest.mark.unit
def test_what_must_agree_is_named_with_both_values(tmp_path: Path) -> None:
    state = load_checkpoint(_save(tmp_path, 1))
    assert _mismatch(state, _loop()) is None
    assert _mismatch(state, _loop(hidden_size=32)) == (
        "loop.resume: checkpoint has loop.hparams.hidden_size=64, this run 32")
    assert _mismatch(state, _loop(lr=0.001)) == (
        "loop.resume: checkpoint has loop.hparams.lr=0.0075, this run 0.001")
    assert _mismatch(state, _loop(anneal_lr=False)) == (
        "loop.resume: checkpoint has loop.hparams.anneal_lr=true, this run false")

    class OtherLoop(PPOLoop):
        pass

    other = OtherLoop()
    assert _mismatch(state, other) == (
        "loop.resume: checkpoint has loop._target_=app.loops.ppo.PPOLoop, this run "
        f"{__name__}.{OtherLoop.__qualname__}")
    # The environment and its spaces, as the run that wrote it recorded them.
    state["settings"]["env.observation_space"] = "Box(shape=(8,), dtype=float32)"
    assert _mismatch(state, _loop()) == (
        "loop.resume: checkpoint has env.observation_space=Box(shape=(8,), dtype=float32), "
        "this run Box(shape=(4,), dtype=float32)")
    del state["settings"]["env.observation_space"]
    # Which normalisers the run has: their statistics are part of the policy it resumes.
    normalised = _loop()
    normalised.env.normalize_obs = True
    assert _mismatch(state, normalised) == (
        "loop.resume: checkpoint has env.normalize_obs=false, this run true")
    # What may change on resume is not recorded at all.
    assert not {k for k in state["settings"] if k.split(".")[-1] in (
        "total_env_steps", "target_return", "window", "checkpoint_every", "max_staleness",
        "verify_weights_every", "progress", "tensorboard", "resume", "seed", "vector")}
    assert not any(k.startswith(("layout", "comm", "launcher")) for k in state["settings"])


@pytest.mark.unit
def test_an_old_checkpoint_without_checksum_is_accepted_with_a_note(tmp_path: Path) -> None:
    state = load_checkpoint(_save(tmp_path, 4))
    old = {k: v for k, v in state.items() if k not in ("checksum", "settings", "format")}
    path = tmp_path / "old" / "ckpt_000004.pt"
    path.parent.mkdir()
    torch.save(old, path)  # as checkpoints were written before they carried a checksum
    picked = newest_valid_checkpoint(path.parent)
    assert picked.path == path and not picked.verified
    assert picked.notes() == [
        f"loop.resume: {path} has no checksum (written before checkpoints carried one): "
        "resuming from it unverified, comparing only its tensor shapes"]
    # Its settings are unknown, but its tensors' shapes still tell a different model apart.
    assert _mismatch(picked.state, _loop()) is None
    assert _mismatch(picked.state, _loop(hidden_size=32)) == (
        "loop.resume: checkpoint has policy tensor critic.0.weight of shape [64, 4], "
        "this run [32, 4]")
