"""Environments: making them, the memory tasks, normalisation, observation history, and spaces
as data."""
