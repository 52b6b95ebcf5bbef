"""A trainer: the module it trains, under DDP or sharded over the trainer grid (``trained.py``),
its gradients averaged over the live trainers when they are elastic (``gradients.py``), and the
trainer role, one update on what reached it (``role.py``). Its membership is the policy of
app/runtime/membership/ (``trainers.py``, ``healing.py``)."""
