"""Where the rollout side of a run is placed: ``BACKENDS`` maps ``config.backend`` to a factory of the
``Rollout`` the driver talks to (``unipg.runtime.driver.Rollout``).

An lm run's learner and replay buffer always stay in the driver's process; a backend decides where its
episodes run. A new backend registers a factory taking the inputs below and returning a ``Rollout``. The
gymnasium driver steps its vectorised environments in process (``local_gym.GymSegments``).
"""

from __future__ import annotations

from unipg.estimate.registry import Registry

BACKENDS = Registry("backend")

# What every backend factory is handed by the lm driver (``unipg.runtime.lm.build_runtime``).
_INPUTS = ("runner", "sampler", "generator", "config", "task", "reward_fn", "schedule", "log")


@BACKENDS.register("inprocess", inputs=_INPUTS)
def inprocess_rollout(runner, sampler, generator, config, task, reward_fn, schedule, log):
    """Episodes in this process: on the learner's own weights (sequential schedule), or on a copy synced by
    version, with its own episode runner and environment service, in a background thread (concurrent)."""
    from unipg.runtime.backends.local_lm import LMRollout, inference_copy
    from unipg.runtime.driver import WeightSync
    from unipg.sample.episodes import EpisodeRunner

    shape = {"group_size": config.sample.samples_per_prompt, "concurrency": config.agent.concurrency}
    if schedule != "concurrent":
        return LMRollout(runner, sampler, generator, **shape)
    copy = inference_copy(runner.policy)
    return LMRollout(EpisodeRunner(copy, task, config, reward_fn), sampler, generator,
                     WeightSync(runner.policy.model, copy.model), owns_runner=True, **shape)


@BACKENDS.register("ray", inputs=_INPUTS)
def ray_rollout(runner, sampler, generator, config, task, reward_fn, schedule, log):
    """Rollout workers (each with its own policy copy) and environment actors on a Ray cluster (section
    ``ray``), with fault tolerance; the schedule is always concurrent."""
    from unipg.runtime.backends.ray_lm import RayRollout

    return RayRollout(runner, sampler, config, generator, task, log=log)
