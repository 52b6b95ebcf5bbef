"""The app's config before any rank starts, in this process: every shipped layout composes and
plans, what the default layout and the elastic ones plan, derived seeds, and the one line each
bad setting gets (Hydra composes, app/launch/planning.py validates). The same through
``python -m app`` is tests/e2e/test_app_cli.py."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir

from app.errors import ConfigError
from app.launch.planning import validate
from tests.helpers.apprun import LAYOUTS, REPO

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_shipped_layout_composes_and_plans(layout: str) -> None:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[f"layout={layout}", "loop=commcheck"])
    plan = validate(cfg)
    assert plan.world_size == cfg.layout.world_size
    assert {"INTRA_NODE", "INTER_NODE", "TRAIN_DATA_PARALLEL"} <= {g.mode for g in plan.groups}


def test_required_layouts_ship() -> None:
    assert {"single", "1t1r", "2t2r", "1t3r", "2x2", "tp2dp2"} <= set(LAYOUTS)


BAD_OVERRIDES = [
    (["comm.timeout=abc"], "comm.timeout"),
    (["comm.timeout=0"], "comm.timeout: must be a positive number of seconds, got 0"),
    (["comm.timeout=-5"], "comm.timeout: must be a positive number of seconds, got -5"),
    (["comm.hang_timeout=0"], "comm.hang_timeout: must be > 0 and < comm.timeout (300), got 0.0"),
    (["comm.timeout=10", "comm.hang_timeout=10"],
     "comm.hang_timeout: must be > 0 and < comm.timeout (10), got 10.0"),
    (["comm.hang_timeout=abc"], "comm.hang_timeout"),
    (["layout=nosuch"], "Could not find 'layout/nosuch'"),
    (["nosuchkey=1"], "Key 'nosuchkey'"),
    (["layout.world_size=0"], "layout.world_size: must be a positive integer, got 0"),
    (["layout.world_size=-4"], "layout.world_size: must be a positive integer, got -4"),
    (["layout.trainers=[]"], "layout.trainers: missing or empty"),
    (["layout.trainers=[a,b]"], "layout.trainers"),
    (["layout.rollouts=[2,9]"], "rank 9 in group [2,9] is out of range for world_size 4"),
    (["layout.rollouts=[1,3]"], "ranks [1] are also trainers"),
    (["+layout.groups={NOPE:[[0,1]]}"], "layout.groups: unknown mode 'NOPE'"),
    (["+layout.groups={WEIGHT_TRANSFER:[[0,2],[2,3]]}"], "rank 2 appears in two groups of one mode"),
    (["layout.ranks_per_node=3"], "layout.world_size: 4 is not a multiple of ranks_per_node 3"),
    (["loop._target_=nosuch.module.Loop"], "loop._target_: cannot import 'nosuch.module.Loop'"),
    (["comm.backend=mpi"], "comm.backend"),
    (["launcher.max_restarts=-1"], "launcher.max_restarts: must be >= 0, got -1"),
    (["launcher.rollout_restarts=-1"], "launcher.rollout_restarts: must be >= 0, got -1"),
    # Elastic trainers (docs/failures.md): where they cannot be, one line naming the setting.
    (["launcher.trainer_restarts=-1"], "launcher.trainer_restarts: must be >= 0, got -1"),
    (["loop=ppo", "layout.elastic_trainers=abc"], "layout.elastic_trainers"),
    (["loop=commcheck", "layout.elastic_trainers=true"],
     "layout.elastic_trainers: true, but CommCheck is not a loop whose trainers follow "
     "membership (the RL runtime's)"),
    (["loop=ppo", "layout=single", "layout.elastic_trainers=true"],
     "layout.elastic_trainers: true, but a lost trainer's rollout ranks move to the others: it "
     "needs rollout ranks of their own with layout.elastic_rollouts on (and gloo)"),
    (["loop=ppo", "layout.elastic_rollouts=false", "layout.elastic_trainers=true"],
     "layout.elastic_trainers: true, but a lost trainer's rollout ranks move to the others"),
    (["loop=ppo", "loop.data_parallel=fsdp", "layout.elastic_trainers=true"],
     "layout.elastic_trainers: true, but sharded trainers (loop.data_parallel=fsdp, tensor or "
     "sequence parallel) cannot rebuild a lost shard from its own grid"),
    (["loop=ppo", "layout.elastic_trainers=false", "launcher.trainer_restarts=1"],
     "launcher.trainer_restarts: 1 restarts a lost trainer, but trainers are static here "
     "(layout.elastic_trainers=false)"),
    (["loop=ppo", "loop.data_parallel=fsdp", "launcher.trainer_restarts=2"],
     "launcher.trainer_restarts: 2 restarts a lost trainer, but trainers are static here "
     "(sharded trainers"),
    (["loop=ppo", "layout=1t3r", "launcher.trainer_restarts=1"],
     "launcher.trainer_restarts: 1, but the one trainer is the lead, whose loss ends the run "
     "(launcher.max_restarts restarts it)"),
    # Replica groups of sharded trainers (layout.trainer_replicas, docs/failures.md).
    (["loop=ppo", "layout.trainer_replicas=0"],
     "layout.trainer_replicas: must be a positive integer, got 0"),
    (["loop=ppo", "layout.trainer_replicas=abc"], "layout.trainer_replicas"),
    (["loop=ppo", "layout.world_size=6", "layout.trainers=3", "loop.data_parallel=fsdp",
      "layout.trainer_replicas=2"],
     "layout.trainer_replicas: 2 does not divide the 3 trainers [0,1,2]"),
    (["loop=ppo", "layout=tp2dp2", "layout.trainer_replicas=3"],
     "layout.trainer_replicas: 3 does not divide the 4 trainers [0,1,2,3]"),
    (["loop=ppo", "layout.world_size=8", "layout.trainers=4", "layout.tensor_parallel_size=2",
      "layout.trainer_replicas=4"],
     "layout.trainer_replicas: 4 does not divide the data-parallel size 2 (the 4 trainers / "
     "(tensor 2 x sequence 1)): each replica group holds whole tensor x sequence blocks"),
    (["loop=ppo", "layout.trainer_replicas=2"],
     "layout.trainer_replicas: 2, but under loop.data_parallel=ddp without tensor or sequence "
     "parallelism every trainer is a replica already"),
    (["loop=ppo", "loop.data_parallel=fsdp", "layout.trainer_replicas=2",
      "layout.elastic_trainers=false"],
     "layout.trainer_replicas: 2 makes replica groups that survive a loss, but trainers are "
     "static here (layout.elastic_trainers=false)"),
    (["launcher.monitor_interval=0"],
     "launcher.monitor_interval: must be a positive number of seconds, got 0.0"),
    (["launcher.shutdown_timeout=-1"],
     "launcher.shutdown_timeout: must be a positive number of seconds, got -1.0"),
    (["launcher.shutdown_timeout=inf"],
     "launcher.shutdown_timeout: must be a positive number of seconds, got inf"),
    # PPO's settings are typed and range-checked before any rank starts.
    (["loop=ppo", "loop.hparams.num_envs=0"], "loop.hparams.num_envs: must be a positive integer, got 0"),
    (["loop=ppo", "loop.hparams.num_envs=abc"], "loop.hparams.num_envs"),
    (["loop=ppo", "loop.hparams.num_minibatches=0"], "loop.hparams.num_minibatches: must be a positive integer, got 0"),
    (["loop=ppo", "loop.hparams.num_minibatches=5000"], "loop.hparams.num_minibatches: must be at most the 1024 samples each trainer gets per update, got 5000"),
    (["loop=ppo", "loop.hparams.lr=-0.1"], "loop.hparams.lr: must be > 0, got -0.1"),
    (["loop=ppo", "loop.hparams.gamma=1.5"], "loop.hparams.gamma: must be in (0, 1], got 1.5"),
    (["loop=ppo", "loop.hparams.gae_lambda=-0.5"], "loop.hparams.gae_lambda: must be in [0, 1], got -0.5"),
    (["loop=ppo", "loop.hparams.nosuch=1"], "Key 'nosuch'"),
    (["loop=ppo", "loop.nosuch=1"], "Key 'nosuch'"),
    (["loop=ppo", "loop.window=0"], "loop.window: must be a positive integer, got 0"),
    (["loop=ppo", "loop.total_env_steps=100"], "loop.total_env_steps: must allow at least one update (2048 env steps"),
    (["loop=ppo", "loop.checkpoint_every=-1"], "loop.checkpoint_every: must be >= 0 (or null), got -1"),
    (["loop=ppo", "loop.checkpoint_every_s=-1"], "loop.checkpoint_every_s: must be >= 0, got -1.0"),
    (["loop=ppo", "loop.checkpoint_keep=0"],
     "loop.checkpoint_keep: must be >= 1 while checkpoints are on (loop.checkpoint_every=0 turns "
     "them off), got 0"),
    (["loop=ppo", "loop.milestone_every_s=-2"], "loop.milestone_every_s: must be >= 0, got -2.0"),
    (["loop=dqn", "loop.replay.checkpoint=true", "loop.checkpoint_every=0"],
     "loop.replay.checkpoint: true, but checkpoints are off (loop.checkpoint_every=0)"),

    (["loop=ppo", "loop.max_staleness=-1"], "loop.max_staleness: must be >= 0, got -1"),
    (["loop=ppo", "loop.min_rollouts=0"], "loop.min_rollouts: must be >= 1, got 0"),
    # Rank r's environments are seeded seed x 10000 + r: gymnasium refuses a negative seed.
    (["loop=ppo", "seed=-1"], "seed: must be between 0 and 1844668873 (rank r's environments are "
     "seeded seed x 10000 + r, which gymnasium takes from 0; "),
    (["loop=ppo", "seed=1844668874"], "seed: must be between 0 and 1844668873 ("),
    (["loop=ppo", "loop.min_rollouts=3"], "loop.min_rollouts: 3, but the layout has 2 rollout ranks"),
    (["loop=ppo", "loop.verify_weights_every=-2"], "loop.verify_weights_every: must be >= 0, got -2"),
    (["loop=sac", "loop.threads=-1"], "loop.threads: must be >= 0, got -1"),
    (["loop=sac", "loop.compile=max"],
     "loop.compile: must be one of off, inductor, cpp_wrapper, got 'max'"),
    (["loop=vtrace", "loop.compile=inductor"],
     "loop.compile: VTrace does not compile its update, got 'inductor' (set off)"),
    # Evaluation beside training (docs/evaluate.md).
    (["loop=ppo", "loop.eval_every=-1"], "loop.eval_every: must be >= 0, got -1"),
    (["loop=ppo", "loop.eval_every=5", "loop.eval_episodes=0"],
     "loop.eval_episodes: must be a positive integer, got 0"),
    (["loop=ppo", "loop.eval_seed=-3"], "loop.eval_seed: must be >= 0, got -3"),
    (["loop=ppo", "loop.stop_on=best"], "loop.stop_on: must be one of train, eval, got 'best'"),
    (["loop=ppo", "loop.stop_on=eval"],
     "loop.stop_on: must be train without evaluations (loop.eval_every=0), got 'eval'"),
    (["loop=ppo", "loop.eval_video=true"],
     "loop.eval_video: must be false without evaluations (loop.eval_every=0), got true"),
    (["loop=ppo", "loop.eval_every=5", "loop.eval_video=true", "loop.env.id=RlcommImage-v0",
      "+loop.env._target_=tests.helpers.image_env.make_image_env", "loop.env.normalize_obs=false"],
     "loop.eval_video: RlcommImage-v0 cannot render: TypeError: "),
    (["loop=ppo", "loop.resume=/nonexistent/run"], "loop.resume: '/nonexistent/run' does not exist"),
    # Experiment trackers (docs/running.md).
    (["loop=ppo", "loop.trackers=[wandb,neptune]"],
     "loop.trackers: unknown tracker 'neptune'; one of tensorboard, wandb, mlflow"),
    (["loop=sac", "loop.trackers=tensorboard"], "loop.trackers"),  # a list, not a name
    (["loop.latency_iters=0"], "loop.latency_iters: must be a positive integer, got 0"),
    (["loop=ppo", "loop._target_=app.loops.commcheck.CommCheck"],
     "loop.total_env_steps: not a setting of app.loops.commcheck.CommCheck; to run your own loop start from loop=custom"),
    (["loop=custom"], "loop._target_: missing"),
    # The environment, built once in the launcher (docs/environments.md).
    (["loop=ppo", "loop.env.id=CartPol-v1"],
     "loop.env.id: 'CartPol-v1' is not a registered Gymnasium environment; did you mean 'CartPole-v1'"),
    (["loop=ppo", "+loop.env.kwargs.foo=1"],
     "loop.env.kwargs: CartPole-v1 rejects {'foo': 1}: "),
    (["loop=ppo", "loop.env.id=Blackjack-v1"],
     "loop.env.id: Blackjack-v1: observation space Tuple("),
    (["loop=ppo", "loop.env.id=LunarLander-v3"],
     "loop.env.id: LunarLander-v3 needs a package that is not installed: "),
    (["loop=ppo", "loop.env.vector=bogus"],
     "loop.env.vector: must be one of sync, async, envpool, got 'bogus'"),
    (["loop=ppo", "loop.env._target_=nosuch.make"], "loop.env._target_: "),
    (["loop=custom", "loop._target_=examples.reinforce.ReinforceLoop", "+loop.hparams.lr=-0.1"],
     "loop.hparams.lr: must be > 0, got -0.1"),
    (["loop=vtrace", "loop.hparams.rho_bar=0"], "loop.hparams.rho_bar: must be > 0, got 0"),
    (["loop=ppo", "+experiment=image", "loop.env.normalize_obs=true"],
     "loop.env.normalize_obs: RlcommImage-v0 has image observations, which the CNN scales to [0, 1] itself; got true"),
    # The trainer grid against the policy (docs/sharding.md).
    (["loop=ppo", "layout.tensor_parallel_size=3"],
     "layout.tensor_parallel_size x sequence_parallel_size: 3 x 1 does not divide the 2 trainers [0,1]"),
    (["loop=ppo", "layout=tp2dp2", "layout.data_parallel_size=4"],
     "layout.data_parallel_size: 4 but the 4 trainers / (tensor 2 x sequence 1) = 2"),
    (["loop=ppo", "layout=tp2dp2"],
     "layout.tensor_parallel_size: 2, but ActorCritic (loop.model.kind=mlp) has no tensor-parallel plan"),
    (["loop=ppo", "layout=tp2dp2", "loop.model.kind=transformer", "loop.model.heads=3",
      "loop.model.width=48"],
     "loop.model.heads: 3 is not divisible by tensor_parallel_size 2"),
    (["loop=ppo", "layout=tp2dp2", "layout.tensor_parallel_size=1", "layout.sequence_parallel_size=2",
      "loop.model.kind=transformer", "loop.model.context=5"],
     "loop.model.context: 5 is not divisible by sequence_parallel_size 2"),
    (["loop=ppo", "layout=tp2dp2", "layout.tensor_parallel_size=1", "layout.sequence_parallel_size=2"],
     "loop.model.kind: mlp, but layout.sequence_parallel_size 2 splits a transformer's window; "
     "use loop.model.kind=transformer"),
    (["loop=ppo", "loop.model.kind=transformer", "loop.model.width=30", "loop.model.heads=4"],
     "loop.model.width: must be divisible by heads (4), got 30"),
    (["loop=ppo", "loop.model.kind=rnn"], "loop.model.kind: must be one of mlp, transformer, got 'rnn'"),
    (["loop=ppo", "loop.data_parallel=zero3"], "loop.data_parallel: must be one of ddp, fsdp, got 'zero3'"),
    (["loop=ppo", "+experiment=image", "loop.model.kind=transformer"],
     "loop.env.id: RlcommImage-v0: "),
]


def compose_and_validate(overrides: list[str]) -> None:
    """What ``python -m app`` does before starting anything: Hydra composes, the app validates."""
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["loop=commcheck", *overrides])
    validate(cfg)


@pytest.mark.parametrize(("overrides", "message"), BAD_OVERRIDES, ids=[" ".join(o[0]) for o in BAD_OVERRIDES])
def test_bad_overrides_are_rejected_before_launch(overrides: list[str], message: str) -> None:
    with pytest.raises(Exception) as failure:
        compose_and_validate(overrides)
    said = f"{failure.value}\n{failure.value.__cause__}"
    assert message in said
    if isinstance(failure.value, ConfigError):
        assert "\n" not in str(failure.value)  # one line


def test_the_default_layout_still_plans_trainers_0_1_and_rollouts_2_3() -> None:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)
    from rlcomm import LayoutSpec, plan_layout

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["loop=commcheck"])
    # Rollout ranks are elastic only under the RL runtime's loops (not commcheck's).
    assert validate(cfg) == plan_layout(LayoutSpec(world_size=4, trainers=[0, 1], rollouts=[2, 3],
                                                   elastic_rollouts=False))


@pytest.mark.parametrize(("overrides", "elastic", "modes"), [
    ([], True, ("GLOBAL", "INTRA_NODE", "INTER_NODE", "WEIGHT_TRANSFER")),
    (["loop=vtrace", "layout=1t3r"], True, ("GLOBAL", "INTRA_NODE", "INTER_NODE",
                                            "WEIGHT_TRANSFER")),
    (["layout.elastic_rollouts=false"], False, ()),
    (["loop=commcheck"], False, ()),  # not a loop that follows membership
    (["comm=nccl"], False, ()),  # epoch groups are gloo
    (["layout=single"], False, ()),  # no rollout ranks
], ids=["default", "vtrace 1t3r", "switched off", "commcheck", "nccl", "colocated"])
def test_which_layouts_have_elastic_rollout_ranks(
    overrides: list[str], elastic: bool, modes: tuple[str, ...]
) -> None:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    plan = validate(cfg)
    assert (plan.elastic_rollouts and bool(plan.rollouts)) == elastic
    assert set(plan.elastic_modes) == set(modes)


@pytest.mark.parametrize(("overrides", "elastic"), [
    ([], True),
    (["loop=vtrace"], True),
    (["loop=dqn", "layout=2t2r"], True),
    (["layout.elastic_trainers=false"], False),
    (["layout.elastic_rollouts=false"], False),  # a lost trainer's rollout ranks move
    (["loop=commcheck"], False),  # not a loop that redoes an update
    (["layout=single"], False),  # colocated: no rollout ranks to move
    (["layout=1t3r"], False),  # the one trainer is the lead
    (["loop.data_parallel=fsdp"], False),  # a lost shard cannot be rebuilt
], ids=["default", "vtrace", "dqn", "switched off", "static rollouts", "commcheck", "colocated",
        "one trainer", "fsdp"])
def test_which_layouts_have_elastic_trainers(overrides: list[str], elastic: bool) -> None:
    import app.__main__  # noqa: F401  (registers the schemas and resolvers)

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=overrides)
    plan = validate(cfg)
    assert plan.elastic_trainers == elastic
    # The lead is never elastic: its loss ends the run (launcher.max_restarts restarts it).
    assert not plan.is_elastic_rank(plan.trainers[0])
    assert all(plan.is_elastic_rank(t) == elastic for t in plan.trainers[1:])


def test_the_spaces_validation_probed_reach_a_rank_that_builds_no_env(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pickle

    import app.__main__  # registers the schemas and resolvers
    import app.runtime.loop
    import app.runtime.settings.schema
    from app.config.schema import AppConfig
    from app.launch.planning import validate_job

    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["loop=ppo"])
    _, job = validate_job(cfg)
    # One typed form: the schema's dataclasses, the loop built and checked.
    assert isinstance(job, AppConfig) and isinstance(job.loop, app.runtime.loop.RLLoop)
    assert job.comm.timeout == cfg.comm.timeout and job.seed == cfg.seed
    probed = job.loop.__dict__["spaces"]

    def no_env(*_: object) -> None:
        raise AssertionError("a rank built an env to probe its spaces")

    monkeypatch.setattr(app.runtime.settings.schema, "probe_spaces", no_env)
    rank_job = pickle.loads(pickle.dumps(job))  # as the local launcher hands it to a rank
    assert rank_job.loop.spaces == probed
    # Spaces that do not pickle stay behind: the rank probes them itself.
    job.loop.__dict__["spaces"] = lambda: None
    assert "spaces" not in pickle.loads(pickle.dumps(job.loop)).__dict__


def test_every_derived_seed_fits_at_the_largest_seed_and_one_more_fails() -> None:
    import torch

    from app.runtime.core.seeds import ENVPOOL_SEED_LIMIT, env_seed, largest_seed, minibatch_seed

    ranks, num_envs, updates = 4, 16, 100
    largest = largest_seed(ranks, num_envs, updates, envpool=False)
    torch.Generator().manual_seed(minibatch_seed(largest, ranks - 1, updates))
    with pytest.raises((RuntimeError, ValueError)):  # torch: "Overflow when unpacking"
        torch.Generator().manual_seed(minibatch_seed(largest + 1, ranks - 1, updates))
    largest = largest_seed(ranks, num_envs, updates, envpool=True)
    assert env_seed(largest, ranks - 1) + num_envs - 1 < ENVPOOL_SEED_LIMIT
    assert env_seed(largest + 1, ranks - 1) + num_envs - 1 >= ENVPOOL_SEED_LIMIT


LAYOUT_OVERRIDES = [
    (["layout.trainers=0"], "layout.trainers: a count must be at least 1, got 0"),
    (["layout.trainers=5"], "layout.trainers: count 5 is more than world_size 4"),
    (["layout.trainers=a-b"], "layout.trainers: 'a-b' is not a rank (8) or a range (0-3)"),
    (['layout.trainers="0-1,7"'], "layout.trainers: rank 7 in '0-1,7' is out of range for world_size 4"),
    (["layout.trainers=0-1", "layout.rollouts=1-3"], "layout.rollouts: ranks [1] are also trainers"),
    (["layout.trainers=1", "layout.rollouts=2"], "layout: ranks [3] are neither trainers nor rollouts"),
    (["layout.trainers=2.5"], "layout.trainers: expected a list of ranks [0,1], a count 2 or ranges"),
    (["layout.nosuch=1"], "Key 'nosuch' not in 'LayoutConfig'"),  # the schema is still strict
    (["layout.ranks_per_node=abc"], "layout.ranks_per_node"),  # and still typed
    (["+layout.groups={WEIGHT_TRANSFER:abc}"], "layout.groups"),
]


@pytest.mark.parametrize(("overrides", "message"), LAYOUT_OVERRIDES,
                         ids=[" ".join(o[0]) for o in LAYOUT_OVERRIDES])
def test_bad_counts_ranges_and_layout_keys_are_rejected_before_launch(
    overrides: list[str], message: str
) -> None:
    with pytest.raises(Exception) as failure:
        compose_and_validate(overrides)
    said = f"{failure.value}\n{failure.value.__cause__}"
    assert message in said
    if message.startswith("layout"):
        assert "\n" not in str(failure.value)  # the planner's one line
