"""The runtime's settings (``loop.*``): their schema (``schema.py``: :class:`RunSettings`) and
what they build (``builders.py``: the policy, the checkpoint cadence, the stop rule, the
summary, the trackers). Their checks before any rank starts are app/runtime/validation.py's."""

from app.runtime.settings.schema import RunSettings, plain

__all__ = ["RunSettings", "plain"]
