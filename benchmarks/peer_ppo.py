"""PPO throughput side by side with Stable-Baselines3, same hyperparameters, same process, one thread.

Both libraries train CartPole-v1 for the same number of steps with unipg's `ppo` preset (8 environments ×
32 steps, mini-batches of 64, 10 epochs, lr 1e-3 decayed linearly, γ 0.98, λ 0.8, clip 0.2, separate
64-64 tanh actor and critic). unipg's periodic evaluation is switched off (one evaluation at the end is
kept, as its result table needs it), TensorBoard is off for both. The runs alternate so that machine noise
hits both alike; the ratio of wall times is the figure to quote.

    pip install -e '.[test]'         # or '.[bench]': stable-baselines3
    python benchmarks/peer_ppo.py --steps 100000 --repeats 2
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import tempfile
import time

import torch


def run_unipg(steps: int, seed: int, output_dir: str) -> tuple[float, float, float]:
    from unipg.config import load_config
    from unipg.runtime.gym import train_gym

    config = load_config(
        None,
        [
            f"seed={seed}",
            f"env.total_steps={steps}",
            f"eval.every_steps={10 * steps}",
            f"log.output_dir={output_dir}",
            "log.progress=false",
            "log.tensorboard=false",
        ],
    )
    start, start_cpu = time.perf_counter(), time.process_time()
    result = train_gym(config)
    return time.perf_counter() - start, time.process_time() - start_cpu, result.final_train_return or float("nan")


def run_sb3(steps: int, seed: int) -> tuple[float, float, float]:
    from stable_baselines3 import PPO
    from stable_baselines3.common.env_util import make_vec_env

    def linear(start: float):
        return lambda progress_remaining: progress_remaining * start

    env = make_vec_env("CartPole-v1", n_envs=8, seed=seed)
    model = PPO(
        "MlpPolicy",
        env,
        n_steps=32,
        batch_size=64,
        n_epochs=10,
        learning_rate=linear(1e-3),
        gamma=0.98,
        gae_lambda=0.8,
        clip_range=0.2,
        ent_coef=0.0,
        vf_coef=0.5,
        max_grad_norm=0.5,
        seed=seed,
        device="cpu",
        verbose=0,
    )
    start, start_cpu = time.perf_counter(), time.process_time()
    model.learn(total_timesteps=steps)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    returns = [info["r"] for info in model.ep_info_buffer]
    return elapsed, cpu, statistics.fmean(returns) if returns else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds: checks that the script still runs, both libraries, measures nothing",
    )
    args = parser.parse_args()
    if importlib.util.find_spec("stable_baselines3") is None:
        raise SystemExit("stable-baselines3 is not installed: pip install -e '.[test]' (or '.[bench]') brings it")
    torch.set_num_threads(1)
    # torch.optim's first optimizer imports torch._dynamo (about a second): imported here, outside both timers
    # like every other import, rather than by whichever library builds the process's first optimizer
    importlib.import_module("torch._dynamo")
    peers = ["unipg", "sb3"]
    if args.smoke:
        args.steps, args.repeats = 2_048, 1
    times: dict[str, list[float]] = {name: [] for name in peers}
    cpu_times: dict[str, list[float]] = {name: [] for name in peers}
    with tempfile.TemporaryDirectory() as output_dir:
        for repeat in range(args.repeats):
            for name in peers if repeat % 2 == 0 else peers[::-1]:
                seconds, cpu_seconds, final_return = (
                    run_unipg(args.steps, repeat, output_dir) if name == "unipg" else run_sb3(args.steps, repeat)
                )
                times[name].append(seconds)
                cpu_times[name].append(cpu_seconds)
                print(
                    f"{name:6s} seed {repeat}: {seconds:6.1f} s ({cpu_seconds:5.1f} s CPU), "
                    f"{args.steps / seconds:7,.0f} steps/s, "
                    f"train return (last 100 episodes) {final_return:.1f}",
                    flush=True,
                )
    unipg, sb3 = statistics.fmean(times["unipg"]), statistics.fmean(times["sb3"])
    print(f"mean wall time: unipg {unipg:.1f} s, sb3 {sb3:.1f} s; unipg/sb3 = {unipg / sb3:.2f}")
    # CPU time of the process: less moved than wall time by other jobs on a shared machine
    unipg_cpu, sb3_cpu = statistics.fmean(cpu_times["unipg"]), statistics.fmean(cpu_times["sb3"])
    print(f"mean CPU time: unipg {unipg_cpu:.1f} s, sb3 {sb3_cpu:.1f} s; unipg/sb3 = {unipg_cpu / sb3_cpu:.2f}")


if __name__ == "__main__":
    main()
