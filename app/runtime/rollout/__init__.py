"""Acting and collecting: the agent that acts (the policy and the normalisers' statistics) and
the worker that steps the environments into segments (``worker.py``)."""
