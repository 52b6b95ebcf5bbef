"""Evaluation: whole episodes of a frozen agent, beside training or after it, and their videos."""
