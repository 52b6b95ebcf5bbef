"""The closing summary: what a person wants to know when a run ends, in result.json and as a
short block on the console."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

RULE = "-" * 72


def run_summary(
    loop_name: str,
    world_size: int,
    restarts: int,
    wall_s: float,
    run_dir: Path,
    loop_summary: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """result.json's ``summary``: facts of every run, then the loop's own figures and files."""
    own = dict(loop_summary or {})
    files = {
        **own.pop("files", {}),
        "logs": str(run_dir / "logs"),
        "result.json": str(run_dir / "result.json"),
    }
    return {
        "loop": loop_name,
        "world_size": world_size,
        "restarts": restarts,
        "wall_s": round(wall_s, 2),
        **own,
        "files": files,
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The console block for a summary made by ``run_summary``."""
    restarts = summary["restarts"]
    scale = f"{summary['world_size']} rank{'s' if summary['world_size'] != 1 else ''}"
    lines = [f"{RULE[:4]} run summary {RULE[17:]}"]
    if "solved" in summary:
        lines += _training_lines(summary)
        share = summary["transfer_share"]
        lines.append(
            f"{summary['env_steps_per_s'] or 0:,.0f} env steps/s, weight transfer "
            f"{'--' if share is None else f'{share:.1%}'} of trainer time, {restarts} restart"
            f"{'s' if restarts != 1 else ''}, {scale} for {summary['wall_s']:.1f} s"
        )
    else:
        lines.append(
            f"{summary['loop']} finished on {scale} in {summary['wall_s']:.1f} s, "
            f"{restarts} restart{'s' if restarts != 1 else ''}"
        )
    lines += _eval_lines(summary)
    replay = summary.get("replay")
    if replay:  # an off-policy run (docs/off-policy.md)
        lines.append(
            f"replay: {replay['replay_size']:,.0f} transitions per trainer, "
            f"{replay['replay_inserts']:,.0f} inserted, {replay['replay_samples']:,.0f} sampled, "
            f"{replay['samples_per_insert']:.2f} samples per insert, priority spread "
            f"{replay['priority_spread']:.2f}, learner waited {replay['learner_wait_updates']} "
            "updates")
        lines.append(f"limiter: collectors waited {replay.get('collector_wait_s', 0):.1f} s, "
                     f"learner waited {replay.get('learner_wait_s', 0):.1f} s")
    changes = summary.get("rollout_ranks")
    if changes:  # an elastic run whose rollout ranks came and went (result.json: leaves, joins)
        grew = f", grew to {changes['grew_to']} ranks" if changes.get("grew_to") else ""
        lines.append(f"rollout ranks: {changes['left']} left, {changes['joined']} joined{grew} "
                     "(result.json: leaves, joins)")
    trainers = summary.get("trainers")
    if trainers:  # elastic trainers lost and healed (result.json: trainer_leaves, trainer_joins)
        lost = trainers.get("transitions_lost")
        grew = f", grew to {trainers['grew_to']} ranks" if trainers.get("grew_to") else ""
        lines.append(f"trainers: {trainers['left']} left, {trainers['joined']} joined{grew}"
                     f"{f', {lost:,} replay transitions lost with them' if lost else ''} "
                     "(result.json: trainer_leaves, trainer_joins)")
    width = max(len(name) for name in summary["files"])
    lines += [f"{name:<{width}}  {_shown(path)}" for name, path in summary["files"].items()]
    return "\n".join([*lines, RULE])


def _eval_lines(summary: dict[str, Any]) -> list[str]:
    """The last evaluation and the best checkpoint (loop.eval_every)."""
    if "eval_episodes" not in summary:
        return []
    last, best = summary["eval"], summary["best_checkpoint"]
    if last is None:
        return ["eval: none finished"]
    lines = [f"eval: mean return {last['return_mean']:.1f} ± {last['return_std']:.1f} over "
             f"{summary['eval_episodes']} episodes (weights v{last['version']}, update "
             f"{last['update']})"]
    if best is not None:
        lines.append(f"best: {best['return_mean']:.1f} (weights v{best['version']}, update "
                     f"{best['update']}) in {_shown(best['path'])}")
    return lines


def _training_lines(summary: dict[str, Any]) -> list[str]:
    target, window = summary["target_return"], summary["window"]
    final = summary["final_mean_return"]
    mean = f"{final:.1f}" if final is not None else "-- (fewer episodes)"
    of = f"mean return of the last {window} episodes"
    if summary.get("stop_on") == "eval":
        last = summary["eval"]
        mean = f"{last['return_mean']:.1f}" if last else "-- (no evaluation)"
        of = f"mean return of an evaluation ({summary['eval_episodes']} episodes)"
    stopped = summary.get("stopped_by")
    if stopped is not None:  # asked to stop (app/runtime/core/stopping.py), with a checkpoint
        reached = (f"; it reached {target:g} after {summary['env_steps_to_target']:,} env steps"
                   if summary["solved"] else "")
        return [f"stopped by {stopped} after {summary['env_steps']:,} env steps: {of} is "
                f"{mean}{reached}; the last checkpoint resumes it (loop.resume=<this run dir>)"]
    if target is None:
        return [f"no target: {of} is {mean} after the budget of {summary['env_steps']:,} "
                "env steps"]
    if summary["solved"]:
        return [
            f"solved: {of} reached {target:g} after {summary['time_to_target_s']:.1f} s of "
            f"training and {summary['env_steps_to_target']:,} env steps (final {mean})"
        ]
    last = summary.get("eval") if summary.get("stop_on") == "eval" else None
    if last is not None and last["return_mean"] >= target:
        # The evaluator runs beside training: its last result can come after the last update,
        # too late for the stop rule.
        return [
            f"not solved within the budget: the evaluation of weights v{last['version']} "
            f"reached {mean} (target {target:g}) after the last update; the budget of "
            f"{summary['env_steps']:,} env steps ended the run"
        ]
    return [
        f"not solved: {of} is {mean}, target {target:g}; the budget of "
        f"{summary['env_steps']:,} env steps ended the run"
    ]


def _shown(path: str) -> str:
    """A path as short as it is unambiguous: relative to the working directory when inside."""
    relative = os.path.relpath(path)
    return path if relative.startswith("..") else relative
