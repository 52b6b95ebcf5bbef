"""The RL runtime's policy over rlcomm.elastic's one membership: which rollout ranks follow which
trainer (``rollouts.py``), the trainers' own membership and who takes a lost trainer's rollout
ranks (``trainers.py``), replica groups rebuilt whole (``replicas.py``), the job's quorum of live
rollout ranks (``quorum.py``), what the hand-off's parts follow (``base.py``), and who reports
at a run's end (``reports.py``). The groups, the store records and the epochs themselves are
rlcomm/elastic/'s."""
