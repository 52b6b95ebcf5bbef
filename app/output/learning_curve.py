"""``learning_curve.png``, drawn from a run's ``metrics.csv`` once it stops (by the launcher's
picture service where there is one: app/output/pictures.py)."""

from __future__ import annotations

import csv
from pathlib import Path


def plot_learning_curve(metrics_csv: Path, png: Path, target: float | None, title: str) -> None:
    """The stop rule's quantity (mean return of the last ``window`` episodes) against env steps
    and against wall time, with each update's mean return faint behind it, and the evaluations'
    mean returns when the run made some."""
    # A Figure of its own, not pyplot's: no global state, safe on the launcher's picture thread.
    from matplotlib.figure import Figure

    with metrics_csv.open() as handle:
        every = list(csv.DictReader(handle))
    rows = [r for r in every if r["mean_return"] not in ("", "nan")]
    # Evaluations (loop.eval_every): at the env steps of the weights they evaluated, and at the
    # wall time they finished.
    evals = [r for r in every if r.get("eval_return_mean") not in (None, "", "nan")]
    fig = Figure(figsize=(10, 4))
    # Fixed margins: tight_layout drew the figure once more to measure it (half the time).
    axes = fig.subplots(1, 2, sharey=True, gridspec_kw={
        "left": 0.09, "right": 0.98, "bottom": 0.12, "top": 0.88, "wspace": 0.05})
    for ax, x_key, label in zip(axes, ("env_steps", "wall_s"), ("env steps", "wall time (s)")):
        x = [float(r[x_key]) for r in rows]
        ax.plot(x, [float(r["mean_return"]) for r in rows], alpha=0.3, label="update mean")
        ax.plot(x, [float(r["return_window"]) for r in rows], label="mean of last window")
        if evals:
            eval_x = "eval_env_steps" if x_key == "env_steps" else x_key
            ax.plot([float(r[eval_x]) for r in evals],
                    [float(r["eval_return_mean"]) for r in evals], marker="o",
                    label="evaluation (deterministic)")
        if target is not None:
            ax.axhline(target, linestyle="--", color="grey")
        ax.set_xlabel(label)
    axes[0].set_ylabel("episodic return")
    axes[0].legend(loc="lower right")
    fig.suptitle(title)
    try:
        fig.savefig(png)
    except OSError as err:
        err.filename = err.filename or str(png)  # matplotlib writes through an open file
        raise
