"""The recorded lockstep trajectory (``tests/data/lockstep_2t2r_seed1.json``) and how to make it.

Recorded once with the lockstep loop as it was before ``loop.max_staleness`` existed; the test
asserts that ``max_staleness=0`` still reproduces it, every update's losses and every rank's
parameter checksum, within :data:`REL_TOL`. Not to the bit: float32 kernels round differently
on another processor (vectorised reductions, MKL's code path), so the same code on another
x86-64 CPU strays in the last bits, and the strays grow a little with every update.

Measured on this 6-update run: another CPU or kernel path (the recording against an AMD EPYC
with AVX-512; there, ATen's avx512/avx2/default kernels and MKL_CBWR=COMPATIBLE/AVX2/AVX512)
moves a value by at most 3.2e-5 relative (losses) and 9.8e-5 (checksums, sums that cancel).
A real change to the update moves it by 1e-2 or more: ent_coef 0 -> 1e-4 by 9.7e-3 (losses) and
1.2e-2 (checksums), the other changes tried (lr +0.1%, vf_coef or max_grad_norm +1%, clip_coef
0.2 -> 0.2002, gae_lambda 0.95 -> 0.951, no value clipping, the biased std in the advantage
normalisation, Adam's eps 1e-5 -> 1e-6) by 4e-2 to 1.5. ``REL_TOL`` sits a decade from both.
A change as small as rounding itself (the advantages' eps 1e-8 -> 1e-6: 1.4e-6) is not seen.

Regenerate (only when a change is meant to alter lockstep training) with
``python -m tests.helpers.lockstep_trajectory``.
"""

from __future__ import annotations

import csv
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.helpers.apprun import describe, run_app

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "lockstep_2t2r_seed1.json"
# 2 collectors x 4 envs x 64 steps = 512 env steps per update: 6 updates.
ARGS = (
    "layout=2t2r",
    "seed=1",
    "loop.hparams.num_envs=4",
    "loop.hparams.num_steps=64",
    "loop.total_env_steps=3072",
    "loop.target_return=1e9",
    "loop.checkpoint_every=0",
    "loop.progress=false",
    # What PPO's defaults were when it was recorded (app/loops/ppo/core.py has other ones now).
    "loop.hparams.lr=2.5e-3",
    "loop.hparams.num_minibatches=4",
)
RECORDED = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac", "mean_return")
REL_TOL = 1e-3  # how far, relative, a value may stray from the recording (see above)


def trajectory(run_dir: Path, *extra: str) -> dict[str, Any]:
    """Run the loop and return each update's losses and every rank's parameter checksum, as
    ``float.hex`` strings (exact)."""
    proc = run_app(*ARGS, *extra, f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, describe(proc)
    with (run_dir / "metrics.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    result = json.loads((run_dir / "result.json").read_text())
    return {
        "args": list(ARGS),
        "updates": [{k: float(row[k]).hex() for k in RECORDED} for row in rows],
        "param_checksum": {
            str(r["rank"]): float(r["result"]["param_checksum"]).hex() for r in result["ranks"]
        },
    }


def deviations(now: dict[str, Any], recorded: dict[str, Any]) -> list[str]:
    """Every recorded value ``now`` does not reproduce within :data:`REL_TOL`, in the order of
    the run (the first one is where training changed); empty when it reproduces them all."""
    pairs = {"updates": (len(now["updates"]), len(recorded["updates"])),
             "ranks": (sorted(now["param_checksum"]), sorted(recorded["param_checksum"]))}
    shape = [f"{what}: {got} now, {want} recorded" for what, (got, want) in pairs.items()
             if got != want]
    if shape:
        return shape
    values = [(f"update {i + 1} {key}", got[key], want[key])
              for i, (got, want) in enumerate(zip(now["updates"], recorded["updates"]))
              for key in RECORDED]
    values += [(f"rank {rank} param_checksum", now["param_checksum"][rank], want)
               for rank, want in recorded["param_checksum"].items()]
    off = []
    for name, got_hex, want_hex in values:
        got, want = float.fromhex(got_hex), float.fromhex(want_hex)
        relative = abs(got - want) / abs(want) if want else abs(got)
        if math.isnan(relative) or relative > REL_TOL:
            off.append(f"{name}: {got!r} now, {want!r} recorded ({relative:.1e} relative > "
                       f"{REL_TOL:g})")
    return off


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        recorded = trajectory(Path(tmp))
    FIXTURE.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
