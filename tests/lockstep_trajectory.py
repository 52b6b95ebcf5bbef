"""The recorded lockstep trajectory (``tests/data/lockstep_2t2r_seed1.json``) and how to make it.

Recorded once with the lockstep loop as it was before ``loop.max_staleness`` existed; the test
asserts that ``max_staleness=0`` still reproduces it to the bit. Regenerate (only when a change
is meant to alter lockstep training) with ``python -m tests.lockstep_trajectory``.
"""

from __future__ import annotations

import csv
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from tests.apprun import describe, run_app

FIXTURE = Path(__file__).resolve().parent / "data" / "lockstep_2t2r_seed1.json"
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
)
RECORDED = ("pg_loss", "v_loss", "entropy", "approx_kl", "clipfrac", "mean_return")


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


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        recorded = trajectory(Path(tmp))
    FIXTURE.write_text(json.dumps(recorded, indent=1) + "\n")
    print(f"wrote {FIXTURE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
