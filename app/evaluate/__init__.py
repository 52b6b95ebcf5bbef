"""Evaluate, watch and export the policy a run produced (docs/evaluate.md)."""
