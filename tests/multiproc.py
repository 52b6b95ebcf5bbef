"""The tests' process runner lives in the library: :mod:`rlcomm.testing`."""

from rlcomm.testing import free_port, rank_env, run_ranks

__all__ = ["free_port", "rank_env", "run_ranks"]
