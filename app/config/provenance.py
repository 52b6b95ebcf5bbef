"""Where a config group's choice came from: the command line, a loop's own default (its YAML's
``override /layout@_global_.layout: NAME``), an experiment's, or the app's (conf/config.yaml).

Hydra records this while it composes (its defaults list's override metadata); it is read back by
computing the defaults list again for the same overrides, which costs a few milliseconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Choice:
    """A group's option and who chose it."""

    group: str
    option: str
    chosen_by: str  # "command line", "loop=dqn", "+experiment=hopper" or "app" (conf/config.yaml)

    def line(self) -> str:
        """``layout: single (loop=dqn's default; layout=... to choose another)``."""
        if self.chosen_by == "command line":
            return f"{self.group}: {self.option} ({self.group}={self.option} on the command line)"
        whose = "the app's default" if self.chosen_by == "app" else f"{self.chosen_by}'s default"
        return f"{self.group}: {self.option} ({whose}; {self.group}=... to choose another)"


def choice_for(group: str, overrides: Sequence[str], config_name: str = "config") -> Choice | None:
    """``group``'s option in a job composed from ``overrides``, and who picked it: "command line",
    the config that overrides it in its defaults list (``loop=dqn``, ``+experiment=x``), or "app";
    None where Hydra is not initialised in this process (a SLURM task, a test calling the app's
    ``run`` directly) or the group is not chosen."""
    from hydra.core.global_hydra import GlobalHydra
    from hydra.types import RunMode

    if not GlobalHydra.instance().is_initialized():
        return None
    loader = GlobalHydra.instance().config_loader()
    defaults = loader.compute_defaults_list(config_name, list(overrides), RunMode.RUN)
    options = [d.config_path.partition("/")[2] for d in defaults.defaults
               if d.parent == config_name and (d.config_path or "").startswith(f"{group}/")]
    if len(options) != 1:
        return None
    metadata = defaults.overrides.override_metadata.get(group)  # Hydra's own record
    if metadata is None:
        return Choice(group, options[0], "app")
    if metadata.external_override:
        return Choice(group, options[0], "command line")
    parent_group, _, option = str(metadata.containing_config_path or "").rpartition("/")
    if parent_group == "experiment":
        return Choice(group, options[0], f"+experiment={option}")
    return Choice(group, options[0], f"{parent_group}={option}" if parent_group else "app")


def job_choice(group: str) -> Choice | None:
    """``group``'s choice in the job Hydra is running in this process, and who made it; None
    outside a Hydra job or where Hydra cannot say."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hydra_cfg = HydraConfig.get()
    try:
        return choice_for(group, list(hydra_cfg.overrides.task), str(hydra_cfg.job.config_name))
    except Exception:  # Hydra's record is a convenience: never the reason a run fails
        return None
