"""Hydra config tree of the app (a package so an installed app finds it)."""
