"""PPO, SAC and DQN against CleanRL's scripts, both sides back to back per seed:
``python -m benchmarks --only learner_speed --cleanrl CHECKOUT/cleanrl/ppo.py --cleanrl-python
PYTHON`` (``--quick``: a smoke at tiny budgets, one seed).

CleanRL is not part of this repository: ``--cleanrl`` names a script in the ``cleanrl/``
folder of a checkout (``ppo.py``, as ``rl_throughput`` takes it), whose siblings
``ppo_continuous_action.py``, ``sac_continuous_action.py`` and ``dqn.py`` this section runs;
``--cleanrl-python`` a Python with CleanRL's own requirements (gymnasium 0.29.1, mujoco 2.3.7:
see ``benchmarks.cleanrl_sac``). Without them the section is one skipped row.

Per algorithm and seed (1, 2, 3), CleanRL first, then ours, alone on the machine:

- **ppo**: ``ppo_continuous_action.py --env-id Hopper-v4 --total-timesteps 1000000`` against
  ``python -m app +experiment=hopper`` on its own layout and compile setting (``layout=1t2r
  loop.compile=inductor``: one trainer, two rollout ranks, the same 2,048 env steps and
  minibatches of 256 per update as on 2t2r, without DDP; docs/mujoco.md); the issue's goal: at
  most 0.2x CleanRL's wall time, the mean return >= 2,100;
- **sac**: ``sac_continuous_action.py --env-id Hopper-v4 --total-timesteps 60000`` against
  ``+experiment=hopper_sac loop.threads=2`` (on its own layout, single; one learner step per env
  step, as CleanRL's); goal: at most 0.5x, the same return band;
- **dqn**: ``dqn.py --env-id CartPole-v1`` until the mean of its last 20 returns reaches 475
  against ``loop=dqn`` (which stops there): time to 475 from launch, goal at most 0.25x.

Each side's wall time (launch to exit), final return (mean of the last 20 episodes), env
steps/s, the ratio (ours / CleanRL: wall time, or time to 475 for DQN), our run's time split
(shares of all ranks' loop time: env stepping, policy forward, update, communication) and the
1-minute load average before and after go into one row per side and seed, and into
``<bench dir>/learner_speed/results.md``: a dated section for ``benchmarks/results/``, with one
plot of both sides' learning curves per algorithm beside it. The full section takes about
2.5 hours on two idle cores (PPO ~70 min, SAC ~80 min, DQN ~10 min); it ignores the shared
10-minute budget and runs only when named.

``python -m benchmarks.learner_speed --cleanrl PPO_PY [--cleanrl-python PYTHON] [--algorithms
ppo,sac,dqn] [--seeds 1,2,3] [--ours OVERRIDE ...] [--quick] [--out DIR]`` runs the same for some
algorithms and seeds, with overrides for our side (``--ours loop.compile=cpp_wrapper``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import Any

from . import cleanrl_dqn, cleanrl_sac, cleanrl_side
from .cleanrl_side import Side, num, ratio
from .core import NUMBER, SECONDS, Goal, Row, Settings
from .mujoco import shares, time_split

NAME = "learner_speed"
SEEDS, QUICK_SEEDS = (1, 2, 3), (1,)
LAST = 20  # episodes in the final mean return, CleanRL's and ours (loop.window)
SPLIT = ("env", "act", "update", "comm")  # time_split_s parts shown, as shares of the loop


@dataclass(frozen=True)
class Pairing:
    """One algorithm's side by side: CleanRL's script and env id, our overrides, the budgets
    (full and ``--quick``) and the goal on the ratio."""

    script: str
    env_id: str
    experiment: str
    extra: tuple[str, ...]
    steps: int
    quick_steps: int
    goal: float
    quick_learning_starts: int | None = None


PAIRINGS = {
    # The experiments' own layouts and compile settings (conf/experiment/): the documented
    # commands, SAC's with the thread of its measured variant.
    "ppo": Pairing("ppo_continuous_action.py", "Hopper-v4", "hopper", (), 1_000_000, 4_096, 0.2),
    "sac": Pairing("sac_continuous_action.py", "Hopper-v4", "hopper_sac",
                   ("loop.threads=2",), 60_000, 1_500, 0.5,
                   quick_learning_starts=500),
    "dqn": Pairing("dqn.py", "CartPole-v1", "", (), 0, 0, 0.25),
}
DQN_QUICK_SECONDS = 20.0  # --quick: CleanRL's dqn.py stops here, ours at as many env steps


def checkout_scripts(settings: Settings) -> Path | None:
    """The ``cleanrl/`` folder of the checkout ``--cleanrl`` points into, or None."""
    return settings.cleanrl.parent if settings.cleanrl is not None else None


def _offpolicy_args(settings: Settings, name: str, folder: Path, out: Path) -> argparse.Namespace:
    """The options ``benchmarks.cleanrl_sac``'s runs take, for PPO or SAC."""
    pairing = PAIRINGS[name]
    steps = pairing.quick_steps if settings.quick else pairing.steps
    return argparse.Namespace(
        cleanrl_script=folder / pairing.script,
        cleanrl_python=settings.cleanrl_python or sys.executable, env_id=pairing.env_id,
        steps=steps, experiment=pairing.experiment, layout=None, threads=None,
        learning_starts=pairing.quick_learning_starts if settings.quick else None,
        last=LAST, timeout=3 * 3600.0, out=out)


def run_pair(settings: Settings, name: str, seed: int, out: Path, extra: Sequence[str] = ()
             ) -> tuple[Side, Side, dict[str, float]]:
    """CleanRL's side, then ours (with the ``extra`` overrides), for one algorithm and seed;
    and our run's time split."""
    folder = checkout_scripts(settings)
    assert folder is not None
    ours: Side | cleanrl_dqn.TargetSide
    cleanrl: Side | cleanrl_dqn.TargetSide
    if name == "dqn":
        args = cleanrl_dqn.parse_args([
            "--cleanrl-script", str(folder / PAIRINGS["dqn"].script), "--cleanrl-python",
            settings.cleanrl_python or sys.executable, "--seeds", str(seed), "--out", str(out),
            *(["--max-seconds", str(DQN_QUICK_SECONDS)] if settings.quick else [])])
        cleanrl = cleanrl_dqn.run_cleanrl(args, seed, out)
        if cleanrl.env_steps is None and cleanrl.episodes:  # not at 475: where it got to
            cleanrl.env_steps = int(cleanrl.episodes[-1][0])
        # --quick: a smoke, as many env steps as CleanRL's took (at least 2,048).
        budget = [f"loop.total_env_steps={max(cleanrl.env_steps or 0, 2_048)}"]
        ours = cleanrl_dqn.run_ours(args, seed, out, [*(budget if settings.quick else []),
                                                       *extra])
    else:
        args = _offpolicy_args(settings, name, folder, out)
        cleanrl = cleanrl_sac.run_cleanrl(args, seed, out)
        overrides = [*cleanrl_sac.our_overrides(args, seed), *PAIRINGS[name].extra, *extra]
        ours, _ = cleanrl_side.run_ours("ours", seed, overrides, out / f"ours_s{seed}",
                                        args.timeout)
    return cleanrl, ours, _split(out / f"ours_s{seed}" / "result.json")


def _split(result_json: Path) -> dict[str, float]:
    """Our run's time split: each part's share of all ranks' loop time (empty without one)."""
    try:
        result = json.loads(result_json.read_text())
    except (OSError, ValueError):
        return {}
    return shares(time_split(result).get("all", {}))


def _to_target(name: str, settings: Settings) -> bool:
    """Whether the sides compare their time to 475 (DQN's), not launch to exit: not in the
    ``--quick`` smoke, whose 20 s reach no target."""
    return name == "dqn" and not settings.quick


def _time(side: Side, to_target: bool) -> float | None:
    """The compared time: time to 475 from launch, or launch to exit."""
    return getattr(side, "target_s", None) if to_target else side.wall_s


def _brief(side: Side) -> dict[str, Any]:
    """A side's figures for results.json, without its episodes (the curve is the picture)."""
    return {k: v for k, v in asdict(side).items() if k != "episodes"}


def rows_of(name: str, pairs: list[tuple[Side, Side, dict[str, float]]], settings: Settings
            ) -> list[Row]:
    """The section's rows for one algorithm: the time ratio over seeds, then the return."""
    to_target = _to_target(name, settings)
    row = Row(NAME, f"{name}: {'time to 475' if to_target else 'wall time'}, ours / CleanRL",
              unit=SECONDS, goal=Goal("<=", PAIRINGS[name].goal), reference_name="CleanRL")
    row.set_per_seed([_time(o, to_target) for _, o, _ in pairs],
                     [_time(c, to_target) for c, _, _ in pairs])
    problems = [f"seed {s.seed} {s.name}: {s.problem[:150]}" for c, o, _ in pairs for s in (c, o)
                if s.problem]
    row.note = "; ".join(problems)
    returns = Row(NAME, f"{name}: final return, last {LAST}", unit=NUMBER,
                  reference_name="CleanRL")
    returns.set_per_seed([o.final_return for _, o, _ in pairs],
                         [c.final_return for c, _, _ in pairs])
    for r in (row, returns):
        r.extra = {"pairs": [{"seed": c.seed, "cleanrl": _brief(c), "ours": _brief(o),
                              "split": split} for c, o, split in pairs]}
    return [row, returns]


def section_lines(results: dict[str, list[tuple[Side, Side, dict[str, float]]]],
                  settings: Settings, extra: Sequence[str] = ()) -> list[str]:
    """The dated Markdown section: one row per algorithm, seed and side."""
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    lines = [f"## The learner against CleanRL, {date.today():%Y-%m-%d}", "",
             f"`python -m benchmarks --only learner_speed{' --quick' if settings.quick else ''}`"
             f" (CleanRL: {checkout_scripts(settings)}"
             f"{'; ours with ' + ' '.join(extra) if extra else ''}); load average at the end "
             f"{load}.", "",
             "| algorithm | seed | side | wall time | time to 475 | final return | env steps/s "
             "| ours / CleanRL | split: env / act / update / comm | load before / after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, pairs in results.items():
        for cleanrl, ours, split in pairs:
            to_target = _to_target(name, settings)
            compared = ratio(_time(ours, to_target), _time(cleanrl, to_target))
            for side in (cleanrl, ours):
                parts = (" / ".join(f"{split.get(p, 0.0):.0%}" for p in SPLIT)
                         if side is ours and split else "")
                note = f" ({side.problem[:80]})" if side.problem else ""
                lines.append(
                    f"| {name} | {side.seed} | {side.name} | {num(side.wall_s, 1)} s | "
                    f"{num(getattr(side, 'target_s', None), 1)} | "
                    f"{num(side.final_return, 1)}{note} | {num(side.steps_per_s)} | "
                    f"{num(compared, 2) if side is ours else ''} | {parts} | "
                    f"{side.load[0]:.2f} / {side.load[1]:.2f} |")
    return lines


def run(settings: Settings) -> list[Row]:
    """The section as ``python -m benchmarks --only learner_speed`` runs it: every algorithm,
    seeds 1-3 (``--quick``: seed 1)."""
    return compare_all(settings, list(PAIRINGS), QUICK_SEEDS if settings.quick else SEEDS)


def compare_all(settings: Settings, algorithms: Sequence[str], seeds: Sequence[int],
                extra: Sequence[str] = ()) -> list[Row]:
    """Each of ``algorithms`` side by side for each of ``seeds``: the rows, the dated section
    and the pictures under ``<out_dir>/learner_speed/``."""
    if checkout_scripts(settings) is None:
        return [Row(NAME, "(section)", status="skipped",
                    note="needs --cleanrl CHECKOUT/cleanrl/ppo.py and --cleanrl-python PYTHON "
                    "(CleanRL's own requirements)")]
    out = settings.out_dir / NAME
    results: dict[str, list[tuple[Side, Side, dict[str, float]]]] = {}
    for name in algorithms:
        for seed in seeds:
            print(f"learner_speed: {name}, seed {seed}: CleanRL, then ours ...", flush=True)
            results.setdefault(name, []).append(run_pair(settings, name, seed, out / name, extra))
    lines = section_lines(results, settings, extra)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    for name, pairs in results.items():
        cleanrl_side.plot([(c, o) for c, o, _ in pairs], LAST,
                          out / f"{name}_learning_curves.png", by_steps=name != "dqn",
                          target=475.0 if name == "dqn" else None)
    rows: list[Row] = []
    for name, pairs in results.items():
        rows += rows_of(name, pairs, settings)
    return rows


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.learner_speed``: the section for some algorithms and seeds, with
    overrides for our side (e.g. ``--ours loop.compile=cpp_wrapper``)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.learner_speed",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--cleanrl", type=Path, required=True, metavar="PPO_PY",
                        help="a script in the cleanrl/ folder of a CleanRL checkout")
    parser.add_argument("--cleanrl-python", default=sys.executable, metavar="PYTHON")
    parser.add_argument("--algorithms", default=",".join(PAIRINGS),
                        help=f"comma-separated, among {', '.join(PAIRINGS)}")
    parser.add_argument("--seeds", default=",".join(map(str, SEEDS)))
    parser.add_argument("--ours", action="append", default=[], metavar="OVERRIDE",
                        help="an override for our side (repeatable)")
    parser.add_argument("--quick", action="store_true", help="the smoke's tiny budgets")
    parser.add_argument("--out", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    algorithms = [a for a in args.algorithms.split(",") if a]
    if not algorithms or set(algorithms) - set(PAIRINGS):
        parser.error(f"--algorithms: choose among {', '.join(PAIRINGS)}")
    settings = Settings(quick=args.quick,
                        out_dir=cleanrl_side.output_dir(args.out, "learner-speed"),
                        cleanrl=args.cleanrl.resolve(), cleanrl_python=args.cleanrl_python)
    rows = compare_all(settings, algorithms, [int(s) for s in args.seeds.split(",")], args.ours)
    print(f"results: {settings.out_dir / NAME / 'results.md'}")
    return 1 if any(r.status != "ok" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
