"""Helpers that test modules share: plain modules, never test modules themselves.

- :mod:`tests.helpers.apprun`: ``python -m app`` run as a user would, its results, no survivors;
- :mod:`tests.helpers.multihost`: network-namespace hosts on this machine (tests/hosts);
- :mod:`tests.helpers.hang_loops`: loops that hang or mismatch on purpose;
- :mod:`tests.helpers.lockstep_trajectory`: the recorded lockstep PPO trajectory;
- :mod:`tests.helpers.weights`: state dicts and modules for the weight-transfer tests;
- :mod:`tests.helpers.checksum_threads`: the weight checksums' helper thread, seen from a test;
- :mod:`tests.helpers.vector_envs`: the vector env contract, checked for one kind;
- :mod:`tests.helpers.disks`: real small disks (tmpfs), filled or read-only;
- :mod:`tests.helpers.screen`: a terminal emulator for what a person sees;
- :mod:`tests.helpers.sweeps`: the PPO loop's metrics and a plugged-in loop with its own;
- :mod:`tests.helpers.transformer_inputs`: a small transformer policy and random inputs;
- :mod:`tests.helpers.single_process`: an algorithm, agent and worker on CartPole, a PPO run;
- :mod:`tests.helpers.image_env`, :mod:`tests.helpers.failing_env`, :mod:`tests.helpers.counting_env`,
  :mod:`tests.helpers.userpkg`: environments and a user package for the tests.

Real ranks come from the library itself: :func:`rlcomm.testing.run_ranks`. Fixtures shared by
several test modules live in tests/conftest.py; the tests themselves, one folder per tier, in
tests/unit, tests/integration, tests/e2e and tests/cluster.
"""
