"""Replay: a trainer's replay shard, the replay on its own ranks, and the off-policy update
behind it."""
