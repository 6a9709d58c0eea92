import json
import math

import pytest
import yaml

from unipg.config import load_config
from unipg.observe.metrics import read_metrics
from unipg.runtime.gym import train_gym

pytestmark = pytest.mark.e2e


def short_config(tmp_path, *overrides):
    return load_config(
        None,
        [
            f"log.output_dir={tmp_path}",
            "log.progress=false",
            "log.tensorboard=false",
            "log.run_name=run",
            "eval.episodes=3",
            *overrides,
        ],
    )


@pytest.mark.parametrize("algorithm", ["reinforce", "a2c", "ppo", "trpo"])
def test_every_algorithm_trains_without_non_finite_metrics(tmp_path, algorithm):
    extra = {
        "reinforce": ["train.batch_transitions=400", "train.mini_batch_transitions=400"],
        "trpo": ["train.batch_transitions=256", "train.mini_batch_transitions=64", "train.critic_updates=2"],
    }.get(algorithm, [])
    config = short_config(tmp_path, f"algorithm={algorithm}", "env.total_steps=1200", *extra)
    result = train_gym(config)
    records = read_metrics(result.run_dir)
    train_records = [r for r in records if "train/update" in r]
    assert train_records, "no training metrics were written"
    for record in train_records:
        for key, value in record.items():
            assert value is not None and math.isfinite(value), f"{algorithm}: {key} is {value}"
    assert result.env_steps == (1200 // config.train.batch_transitions) * config.train.batch_transitions


def test_metrics_are_namespaced_and_the_config_is_saved(tmp_path):
    config = short_config(tmp_path, "algorithm=ppo", "env.total_steps=512", "log.tensorboard=true")
    result = train_gym(config)
    last = read_metrics(result.run_dir)[-1]
    for key in (
        "train/policy_loss",
        "train/value_loss",
        "train/approx_kl",
        "train/clip_fraction",
        "train/entropy",
        "train/explained_variance",
        "train/grad_norm",
        "train/learning_rate",
        "timing/steps_per_second",
        "timing/rollout",
        "timing/update",
        "rollout/episode_return",
    ):
        assert key in last, key
    saved = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    assert saved["algorithm"] == "ppo" and saved["env"]["total_steps"] == 512
    assert any((result.run_dir / "tensorboard").iterdir())


def test_linear_schedule_anneals_the_learning_rate(tmp_path):
    config = short_config(tmp_path, "algorithm=ppo", "env.total_steps=1024", "train.lr_schedule=linear")
    rates = [r["train/learning_rate"] for r in read_metrics(train_gym(config).run_dir) if "train/learning_rate" in r]
    assert rates[0] == pytest.approx(1e-3) and rates == sorted(rates, reverse=True) and rates[-1] < rates[0]


def test_gaussian_policy_trains_on_a_continuous_environment(tmp_path):
    config = short_config(
        tmp_path,
        "algorithm=ppo",
        "env.id=Pendulum-v1",
        "env.num_envs=2",
        "env.total_steps=512",
        "estimator.normalize_rewards=true",
    )
    assert math.isfinite(train_gym(config).final_eval_mean)


def test_same_seed_gives_identical_metrics(tmp_path):
    runs = []
    for name in ("a", "b"):
        config = short_config(
            tmp_path, "algorithm=ppo", "env.total_steps=768", "deterministic=true", f"log.run_name={name}"
        )
        records = read_metrics(train_gym(config).run_dir)
        runs.append([{k: v for k, v in r.items() if not k.startswith("timing/") and k != "time"} for r in records])
    assert json.dumps(runs[0]) == json.dumps(runs[1])


def test_ppo_learns_cartpole(tmp_path):
    """A regression guard on the whole path: PPO must clearly improve on a random policy (≈ 22)."""
    config = short_config(tmp_path, "algorithm=ppo", "env.total_steps=15360", "eval.episodes=10")
    result = train_gym(config)
    assert result.final_eval_mean >= 150, result.eval_history


def test_an_existing_run_is_never_appended_to(tmp_path):
    config = short_config(tmp_path, "algorithm=ppo", "env.total_steps=256")
    first = train_gym(config)
    before = (first.run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(ValueError, match="already holds a run"):
        train_gym(config)
    assert (first.run_dir / "metrics.jsonl").read_bytes() == before


def test_automatic_run_names_do_not_collide(tmp_path):
    config = load_config(
        None,
        [
            f"log.output_dir={tmp_path}",
            "log.progress=false",
            "log.tensorboard=false",
            "env.total_steps=256",
            "eval.episodes=2",
        ],
    )
    assert train_gym(config).run_dir != train_gym(config).run_dir


GYM_RUN_IMPORTS = """
import sys
from unipg.config import load_config
from unipg.runtime.gym import train_gym

config = load_config(None, [
    "log.output_dir=" + sys.argv[1], "log.progress=false", "log.tensorboard=false", "eval.episodes=2",
    "env.total_steps=512", "algorithm=ppo",
])
train_gym(config)
print(sorted(name for name in ("transformers", "peft", "vllm") if name in sys.modules))
"""


def test_a_gymnasium_run_never_imports_the_language_model_stack(tmp_path):
    """transformers alone takes seconds to import, most of a short gym run's start; the gym path needs none of it."""
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", GYM_RUN_IMPORTS, str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "[]"
