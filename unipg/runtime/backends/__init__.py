"""Where the roles of a run are placed: ``BACKENDS`` maps ``config.backend`` to a factory of the ``Rollout``
the driver talks to (``unipg.runtime.driver.Rollout``), ``LEARNER_RANKS`` to the launcher of a sharded
learner's ranks (``unipg.learn.sharded.Ranks``, ``train.learner_processes`` > 1).

An lm run's replay buffer, and its learner's handle, stay in the driver's process; a backend decides where its
episodes run and where the ranks of a sharded learner run. A new backend registers a factory taking the inputs
``BACKEND_INPUTS`` and returning a ``Rollout``, with that class as its return annotation
(``tests/runtime/test_rollout_protocol.py`` checks that every registered backend's class implements the whole
protocol), and a launcher. The gymnasium driver steps its vectorised environments in process
(``local_gym.GymSegments``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from unipg.config import Config
from unipg.registry import Registry

if TYPE_CHECKING:  # imported when built: Ray is optional, and a gymnasium run needs no language-model stack
    from unipg.learn.lm import LMLearner
    from unipg.learn.role_learners import RoleLearners
    from unipg.learn.sharded import ShardedLMLearner
    from unipg.policy.lm import LMPolicy
    from unipg.runtime.backends.local_lm import LMRollout
    from unipg.runtime.backends.ray_lm import RayRollout

BACKENDS = Registry("backend")
LEARNER_RANKS = Registry("backend")

# What the lm driver hands every backend factory, by keyword (``unipg.runtime.lm_run.build_runtime``): the episode
# runner, the prompt sampler, the sampling generator, the config, the task, the reward function, the schedule
# (sequential or concurrent) and where to log.
BACKEND_INPUTS = ("runner", "sampler", "generator", "config", "task", "reward_fn", "schedule", "log")


@BACKENDS.register("inprocess", inputs=BACKEND_INPUTS)
def inprocess_rollout(runner, sampler, generator, config, task, reward_fn, schedule, log) -> LMRollout:
    """Episodes in this process: on the learner's own weights (sequential schedule), or on a copy synced by
    version, with its own episode runner and environment service, in a background thread (concurrent)."""
    from unipg.runtime.backends.local_lm import LMRollout, inference_copy
    from unipg.runtime.driver import WeightSync
    from unipg.sample.episodes import EpisodeRunner

    shape = {"group_size": config.sample.samples_per_prompt, "concurrency": config.agent.concurrency}
    if schedule != "concurrent":
        return LMRollout(runner, sampler, generator, **shape)
    copy = inference_copy(runner.policy)  # with a model per role, a copy of each role's (synced as one)
    return LMRollout(
        EpisodeRunner(copy, task, config, reward_fn),
        sampler,
        generator,
        WeightSync(runner.policy.model, copy.model),
        owns_runner=True,
        **shape,
    )


@BACKENDS.register("ray", inputs=BACKEND_INPUTS)
def ray_rollout(runner, sampler, generator, config, task, reward_fn, schedule, log) -> RayRollout:
    """Rollout workers (each with its own policy copy) and environment actors on a Ray cluster (section
    ``ray``), with fault tolerance; the schedule is always concurrent."""
    from unipg.runtime.backends.ray_lm import RayRollout

    return RayRollout(runner, sampler, config, generator, task, log=log)


@LEARNER_RANKS.register("inprocess")
def local_ranks():
    """Spawned processes on this machine (gloo or NCCL on the loopback address)."""
    from unipg.learn.sharded import LocalRanks

    return LocalRanks


@LEARNER_RANKS.register("ray")
def ray_ranks():
    """Ray actors reserved together in a placement group (``ray.learner_*``)."""
    from unipg.runtime.backends.ray_learner import RayRanks

    return RayRanks


def make_learner(policy: LMPolicy, config: Config) -> LMLearner | ShardedLMLearner | RoleLearners:
    """The run's learner: in this process, or sharded over ``train.learner_processes`` ranks that the run's
    backend places."""
    from unipg.learn.lm import LMLearner
    from unipg.learn.role_learners import RoleLearners
    from unipg.learn.sharded import ShardedLMLearner

    processes = config.train.learner_processes
    if config.agent.role_policy == "separate":  # a model per role, each with its own learner (one process)
        return RoleLearners(policy, config)
    if processes == 1:
        return LMLearner(policy, config)
    return ShardedLMLearner(policy, config, processes, LEARNER_RANKS.get(config.backend)())
