"""``python -m benchmarks --only membership_scale`` (docs/benchmarks.md, "One store, N
members"), measured on 4 members so that it cannot break unseen: an epoch forms with every
member acknowledging, a stopped heartbeat is noticed, the store's requests are counted as the
protocol sends them, and no process of it outlives it."""

from __future__ import annotations

import psutil
import pytest

from benchmarks.__main__ import parse_args, selected
from benchmarks.membership_scale import NAME, Scale, measure_apart, rows_of, table
from rlcomm.elastic import BEAT_LOST_S, BEAT_S

pytestmark = pytest.mark.integration

N = 4


def _leftover(marker: str) -> list[int]:
    """Processes whose command line holds ``marker`` (the run's own output path)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if marker in " ".join(proc.info["cmdline"] or []):
            found.append(proc.info["pid"])
    return found


@pytest.fixture(scope="module")
def scale(tmp_path_factory: pytest.TempPathFactory) -> Scale:
    out = tmp_path_factory.mktemp("membership_scale") / "n4.json"
    # A patience of 30 s: a loss that goes unnoticed fails the test in 30 s, not 216.
    measured = measure_apart(N, out, "--processes", "2", "--idle-s", "1",
                             "--form-window-s", "0.3", "--losses", "1", "--patience-s", "30")
    assert _leftover(str(out)) == []  # the store's and the members' processes all ended
    return measured


def test_an_epoch_forms_with_every_member_acknowledging(scale: Scale) -> None:
    assert (scale.n, scale.processes) == (N, 2)
    assert len(scale.form_s) >= 3 and scale.left_out == 0
    assert all(0 < s < 60 for s in scale.form_s + scale.settle_s)
    forming = scale.forming
    assert forming is not None
    epochs = len(scale.form_s)
    # Per member and epoch at least: the latest epoch (a get: 2 on the wire), its
    # acknowledgement (a set), the wait for the settled members and their get (1 + 2).
    assert forming.requests["member"] >= 6 * N * epochs
    # Per epoch at least: the proposal and the latest (2 sets), each acknowledgement checked
    # while waiting and once more as it settles, the settled members (a set).
    assert forming.requests["leader"] >= (2 * N + 3) * epochs
    # The store answered all but the sets (they have no answer): never more than was sent.
    assert 0 < forming.responses_per_s * forming.wall_s <= sum(forming.requests.values())
    assert 0 <= forming.cpu <= 1.5  # the store serves on one thread


def test_only_heartbeats_reach_the_store_between_epochs(scale: Scale) -> None:
    idle = scale.idle
    assert idle is not None
    assert idle.requests["member"] == idle.requests["leader"] == 0
    due = N * idle.wall_s / BEAT_S
    # Each beats every BEAT_S once its last beat returned: never more than due (one more at
    # the window's edge), and far from none.
    assert 0.25 * due <= idle.requests["heartbeat"] <= due + N


def test_a_stopped_heartbeat_is_noticed_and_the_epoch_settles_without_it(scale: Scale) -> None:
    assert len(scale.notice_s) == 1 and scale.false_losses == 0
    noticed, settled = scale.notice_s[0], scale.lose_s[0]
    assert BEAT_LOST_S <= noticed <= settled < BEAT_LOST_S + 30


def test_its_rows_and_table_carry_every_figure_with_the_load(scale: Scale) -> None:
    rows = rows_of(scale)
    assert len(rows) == 6 and all(row.status == "ok" and row.rlcomm for row in rows)
    assert all("load " in row.note and row.extra["load"] == scale.load for row in rows)
    line = table([scale]).splitlines()[-1]
    one_minute = [scale.load[phase].split(" / ")[0] for phase in ("start", "idle", "form", "lose")]
    assert line.startswith(f"| {N} (2) |") and line.endswith(f"| {', '.join(one_minute)} |")


def test_it_runs_only_when_named() -> None:
    assert NAME not in selected(parse_args([]))
    assert selected(parse_args(["--only", NAME])) == [NAME]
