"""The seeds a run derives from the user's ``seed``: each derivation has its home here, used by
the ranks (app/runtime/run.py) and by the check before launch (:func:`seed_problem`)."""

from __future__ import annotations

RANK_STRIDE = 10_000  # rank r's environments (a replay rank's sampling): seed x RANK_STRIDE + r
UPDATE_STRIDE = 1_000_003  # a replica's minibatch order, one stream per update
TORCH_SEED_LIMIT = 2**64  # torch.Generator.manual_seed takes seeds below it
ENVPOOL_SEED_LIMIT = 2**31  # envpool seeds its pool with an int32


def env_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s vector env (sub-env ``i`` is seeded with it + ``i``) and of
    its acting generator."""
    return seed * RANK_STRIDE + rank


def replay_seed(seed: int, rank: int) -> int:
    """The seed of replay rank ``rank``'s sampling generator (``layout.replay``): the rule of
    :func:`env_seed`, whose rank it is (a replay rank steps no envs), so the bounds checked
    before launch (:func:`seed_problem`, over every rank) hold for it too."""
    return env_seed(seed, rank)


def minibatch_seed(seed: int, replica: int, update: int) -> int:
    """The seed of a trainer replica's minibatch order at ``update``: a resume shuffles alike."""
    return env_seed(seed, replica) * UPDATE_STRIDE + update


def largest_seed(ranks: int, num_envs: int, updates: int, envpool: bool) -> int:
    """The largest ``seed`` whose derived seeds all fit, for ``ranks`` ranks of ``num_envs``
    envs each and at most ``updates`` updates (``envpool``: its int32 bounds the env seeds)."""
    last_rank = ranks - 1
    largest = ((TORCH_SEED_LIMIT - 1 - updates) // UPDATE_STRIDE - last_rank) // RANK_STRIDE
    if envpool:
        largest = min(largest, (ENVPOOL_SEED_LIMIT - num_envs - last_rank) // RANK_STRIDE)
    return largest


def seed_problem(seed: int, ranks: int, num_envs: int, updates: int, envpool: bool) -> str | None:
    """The one line for a ``seed`` that gives some rank a seed its library refuses, else None."""
    largest = largest_seed(ranks, num_envs, updates, envpool)
    if 0 <= seed <= largest:
        return None
    env_limit = "envpool takes from 0 to 2**31 - 1" if envpool else "gymnasium takes from 0"
    return (f"seed: must be between 0 and {largest} (rank r's environments are seeded seed x "
            f"{RANK_STRIDE} + r, which {env_limit}; its minibatches (seed x {RANK_STRIDE} + r) "
            f"x {UPDATE_STRIDE} + update, which torch takes below 2**64), got {seed}")
