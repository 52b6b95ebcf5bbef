"""The roles a rank takes, one per job it does (app/runtime/compose.py assigns them): the
:class:`~app.runtime.roles.collector.Collector` steps environments, the
:class:`~app.runtime.trainer.role.Trainer` updates the policy, the
:class:`~app.runtime.roles.decider.Decider` takes the stop decision with its records, checkpoints
and evaluations. The replay server (app/runtime/replay/service.py) and the evaluator
(app/runtime/evaluation/evaluator.py) run in threads and processes of their own."""
