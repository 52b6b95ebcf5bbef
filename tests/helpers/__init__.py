"""Helpers that test modules share: plain modules, never test modules themselves.

- :mod:`tests.helpers.apprun`: ``python -m app`` run as a user would, its results, no survivors;
- :mod:`tests.helpers.multihost`: network-namespace hosts on this machine (tests/hosts);
- :mod:`tests.helpers.hang_loops`: loops that hang or mismatch on purpose;
- :mod:`tests.helpers.lockstep_trajectory`: the recorded lockstep PPO trajectory;
- :mod:`tests.helpers.weights`: state dicts and modules for the weight-transfer tests.

Real ranks come from the library itself: :func:`rlcomm.testing.run_ranks`. Fixtures shared by
several test modules live in tests/conftest.py.
"""
