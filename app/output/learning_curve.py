"""``learning_curve.png``, drawn from a run's ``metrics.csv`` once it stops (by the launcher's
picture service where there is one: app/output/pictures.py).

The file is read as a stream and at most :data:`MOST_POINTS` of its rows are drawn (every k-th
row, the last always), so drawing a run of a week takes the memory of a short one and time
linear in the file."""

from __future__ import annotations

import csv
from collections.abc import Iterator
from pathlib import Path

MOST_POINTS = 5_000
COLUMNS = ("env_steps", "wall_s", "mean_return", "return_window")
EVAL_COLUMNS = ("eval_env_steps", "wall_s", "eval_return_mean")


def _rows(metrics_csv: Path) -> Iterator[dict[str, str]]:
    with metrics_csv.open(newline="") as handle:
        yield from csv.DictReader(handle)


def thinned_rows(metrics_csv: Path, most: int = MOST_POINTS) -> tuple[list[dict[str, str]],
                                                                      list[dict[str, str]]]:
    """The rows to draw (every k-th row with a mean return, at most ``most`` and the last
    among them) and the evaluations' rows (every one, or every 2^j-th of a great many), read
    as a stream: only what is drawn is kept."""
    with metrics_csv.open("rb") as handle:
        lines = sum(chunk.count(b"\n") for chunk in iter(lambda: handle.read(1 << 20), b""))
    stride = max(1, -(-lines // most))
    drawn: list[dict[str, str]] = []
    evals: list[dict[str, str]] = []
    last: dict[str, str] | None = None
    for index, row in enumerate(_rows(metrics_csv)):
        if row.get("eval_return_mean") not in (None, "", "nan"):
            evals.append({k: row[k] for k in EVAL_COLUMNS})
            if len(evals) > 2 * most:  # halved whenever it doubles: every 2^j-th evaluation
                evals = evals[::2]
        if row["mean_return"] in ("", "nan"):
            continue
        last = {k: row[k] for k in COLUMNS}
        if index % stride == 0:
            drawn.append(last)
    if last is not None and (not drawn or drawn[-1] is not last):
        drawn.append(last)
    return drawn, evals


def plot_learning_curve(metrics_csv: Path, png: Path, target: float | None, title: str) -> None:
    """The stop rule's quantity (mean return of the last ``window`` episodes) against env steps
    and against wall time, with each update's mean return faint behind it, and the evaluations'
    mean returns when the run made some."""
    # A Figure of its own, not pyplot's: no global state, safe on the launcher's picture thread.
    from matplotlib.figure import Figure

    # Evaluations (loop.eval_every): at the env steps of the weights they evaluated, and at the
    # wall time they finished.
    rows, evals = thinned_rows(metrics_csv)
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
