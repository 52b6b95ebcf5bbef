"""Replay: a replay shard and its rate limiter (buffer), what an off-policy algorithm sees of
its replay (client), the replay on its own ranks (service, messages, routing), and the
off-policy update behind it (offpolicy)."""
