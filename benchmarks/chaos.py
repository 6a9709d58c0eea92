"""Fault injection: an agent training run through failing tools, lost episodes, NaN gradients and SIGKILLs.

Workload: the calculator agent of ``configs/calculator_agent.yaml`` started from its warm start trained on
tool demonstrations only (``tool_demonstrations=1.0``), so nearly every episode calls the tool. The tool is
wrapped by the ``faulty`` tool (``unipg.tools.faulty``): calls raise, hang past the timeout (some catching
every cancellation, as a badly written async tool does, so that they never end), return garbage or 10 MB of
text at the given rates. Three phases, each checked for what a long run needs:

1. ``inprocess``: concurrent schedule (staleness 1) in one process; a chaos thread cancels a running group
   of episodes every ``--interrupt-every`` seconds (``LMRollout.interrupt``); NaN gradients are injected at
   ``--nan-updates`` (a backward hook on the policy's first parameter), with ``rollback.enabled``.
2. ``ray`` (``--ray``): the same on the Ray backend (2 rollout workers, 1 environment actor); the chaos
   thread kills a rollout worker (``ray.kill``) every ``--kill-every`` seconds instead.
3. ``sigkill``: the deterministic sequential schedule (still with tool faults) run in a subprocess that is
   SIGKILLed at random moments (with ``--kill-at-checkpoint N``: as soon as it has saved checkpoint N, which
   the smoke run uses) and resumed with ``unipg train --resume`` until it finishes; its final weights are
   compared, bit for bit, with an uninterrupted run of the same configuration.

For 1–2 the run must finish every update; every episode must be accounted for (started = finished + failed +
requeued + cancelled + in flight, and the finished ones = trained on + dropped as stale + evicted + rejected
by dynamic sampling + left in the buffer: nothing lost); the metrics must hold each update exactly once; the
final checkpoint must load; and the learner's longest wait for data is reported against the limit after which
a hung group is cut: in-process turns × (retries + 1) × tool timeout (tool calls are the only thing that can
hang), on Ray ``ray.episode_timeout`` (a worker holding a request that long is killed and its episodes run
again).
``train_lm`` is the unmodified driver; the benchmark reaches its runtime and policy by wrapping
``build_runtime`` and ``policy_from_config`` in ``unipg.runtime.lm_run``.

    python benchmarks/chaos.py                   # in-process and sigkill phases
    python benchmarks/chaos.py --ray --updates 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import torch

import unipg.runtime.lm as text
import unipg.runtime.lm_run as run_parts
from unipg.checkpoint.files import load_checkpoint
from unipg.checkpoint.store import CheckpointStore
from unipg.config import load_config
from unipg.observe.metrics import read_metrics

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "calculator_agent.yaml"


# --smoke: a tiny run of the same code path, to check that the script still runs (its figures mean nothing); a warm
# start on tool demonstrations short enough for a test, after which nearly every episode calls the tool, so that the
# smoke run meets the tool's faults (those that never end included) and still finishes
SMOKE = [
    "task.options={digits: 1, num_train: 16, num_test: 4, tool_demonstrations: 1.0}",
    "model.warm_start=true",
    "sft.stages=[]",
    "sft.evidence_stop=off",
    "sft.steps=50",
    "sft.batch_size=16",
    "sft.learning_rate=1e-2",
    "train.batch_size=8",
    "train.mini_batch_size=8",
    "train.micro_batch_size=8",
    "sample.samples_per_prompt=4",
    "sample.max_new_tokens=96",
    "agent.max_total_tokens=160",
    "eval.max_examples=4",
    "eval.pass_k=0",
    "agent.tool_timeout=0.3",
]


def configuration(args, output_dir: str, name: str, *extra: str):
    faulty = (
        f"task.tools=[{{name: faulty, options: {{tool: calculator, raise_rate: {args.raise_rate}, "
        f"hang_rate: {args.hang_rate}, garbage_rate: {args.garbage_rate}, huge_rate: {args.huge_rate}, "
        f"hang_uncancellable_rate: {args.hang_uncancellable_rate}}}}}]"
    )
    overrides = [
        "task.options={digits: 3, operations: '*', tool_demonstrations: 1.0}",
        faulty,
        "agent.tool_timeout=1.0",
        "agent.tool_retries=1",
        f"train.updates={args.updates}",
        "train.batch_size=64",
        "train.mini_batch_size=64",
        "train.micro_batch_size=32",
        "eval.every_updates=1000",
        "eval.max_examples=32",
        "checkpoint.every_updates=2",
        "rollback.enabled=true",
        f"log.output_dir={output_dir}",
        f"log.run_name={name}",
        "log.progress=false",
        "log.tensorboard=false",
        *extra,
        *(SMOKE if args.smoke else []),
    ]
    return overrides


class Chaos:
    """A thread that breaks things while ``train_lm`` runs, and what it injected."""

    def __init__(self, args, backend: str):
        self.args, self.backend = args, backend
        self.runtimes, self.injected, self.nan_updates = [], Counter(), set(args.nan_updates)
        self._stop = threading.Event()
        self._rng = random.Random(args.seed)
        self._original_build, self._original_policy = run_parts.build_runtime, run_parts.policy_from_config

    def __enter__(self) -> Chaos:
        def build_runtime(*a, **k):
            self.runtimes.append(self._original_build(*a, **k))
            return self.runtimes[-1]

        def policy_from_config(config, roles=()):
            policy = self._original_policy(config, roles)
            backward = {"calls": 0}
            per_update = config.train.batch_size // config.train.micro_batch_size * config.train.num_epochs

            def poison(gradient):
                backward["calls"] += 1
                update = (backward["calls"] - 1) // per_update + 1
                if update in self.nan_updates and (backward["calls"] - 1) % per_update == 0:
                    self.injected["nan_gradient"] += 1
                    return gradient * float("nan")
                return gradient

            next(policy.model.parameters()).register_hook(poison)
            return policy

        run_parts.build_runtime, run_parts.policy_from_config = build_runtime, policy_from_config
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        every = self.args.kill_every if self.backend == "ray" else self.args.interrupt_every
        while not self._stop.wait(every * (0.5 + self._rng.random())):
            if not self.runtimes:
                continue
            rollout = self.runtimes[-1].rollout
            try:
                if self.backend == "ray":
                    import ray

                    if rollout.workers:
                        ray.kill(self._rng.choice(rollout.workers), no_restart=True)
                        self.injected["worker_killed"] += 1
                else:
                    self.injected["group_cancelled"] += rollout.interrupt(1)
            except Exception as error:  # noqa: BLE001 — a fault the chaos itself hit is reported, not fatal
                print(f"chaos: {type(error).__name__}: {error}", flush=True)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        run_parts.build_runtime, run_parts.policy_from_config = self._original_build, self._original_policy


def tool_faults(runtime) -> Counter:
    """Faults the rollout's faulty tool injected (in-process; on Ray they happen in the environment actors)."""
    service = getattr(getattr(runtime.rollout, "runner", None), "service", None)
    tool = service.tools.get("calculator") if service is not None else None
    return Counter(getattr(tool, "injected", {}))


def run_phase(args, backend: str, output_dir: str) -> dict:
    extra = ["runtime.max_staleness=1", "runtime.schedule=concurrent", f"backend={backend}"]
    if backend == "ray":
        extra += [
            "ray.rollout_workers=2",
            "ray.env_workers=1",
            "ray.episodes_per_worker=32",
            "ray.rollout_num_cpus=0.5",
            "ray.env_num_cpus=0",
            "ray.max_restarts=100",
            "ray.max_attempts=5",
        ]
    config = load_config(CONFIG, configuration(args, output_dir, backend, *extra))
    start, error = time.time(), None
    with Chaos(args, backend) as chaos:
        try:
            result = text.train_lm(config)
            run_dir = result.run_dir
        except Exception as failure:  # noqa: BLE001 — the report says the run did not survive, and why
            error, run_dir = f"{type(failure).__name__}: {failure}", Path(output_dir) / backend
    runtime = chaos.runtimes[-1] if chaos.runtimes else None
    injected = chaos.injected + (tool_faults(runtime) if runtime is not None else Counter())
    records = [r for r in read_metrics(run_dir) if "train/loss" in r]
    steps = [r["step"] for r in records]
    last = records[-1] if records else {}
    # the rollout's final counts, after it stopped (episodes in flight then count as cancelled)
    account = vars(runtime.rollout.account) if runtime is not None else {}
    trained = int(last.get("train/samples", 0))
    dropped = int(  # dropped as stale, evicted, or rejected by dynamic sampling (``sample.dynamic_sampling``)
        sum(r.get("async/dropped_stale", 0) + r.get("async/evicted", 0) + r.get("async/filtered", 0) for r in records)
    )
    left = len(runtime.buffer) if runtime is not None else 0
    if runtime is not None:  # groups dropped or rejected after the last update's metrics were written
        unlogged = runtime.buffer.stats
        dropped += unlogged.dropped_stale + unlogged.evicted + unlogged.filtered
    balance = account["started"] - sum(account[p] for p in ("finished", "failed", "requeued", "cancelled", "in_flight"))
    unconsumed = account["finished"] - trained - dropped - left
    events = (
        [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        if (run_dir / "events.jsonl").is_file()
        else []
    )
    try:
        final = load_checkpoint(CheckpointStore(run_dir / "checkpoints").latest())
        loads = final.step == args.updates and all(torch.isfinite(t).all() for t in final.tensors["policy"].values())
    except Exception:  # noqa: BLE001 — reported as "does not load"
        loads = False
    agent = config.agent  # what cuts a hung group: tool timeouts in-process, ray.episode_timeout on Ray
    bound = (
        config.ray.episode_timeout
        if backend == "ray"
        else (agent.max_turns or 2) * (agent.tool_retries + 1) * agent.tool_timeout
    )
    return {
        "phase": backend,
        "error": error,
        "seconds": time.time() - start,
        "injected": dict(injected),
        "updates": len(records),
        "steps_ok": steps == list(range(1, args.updates + 1)),
        "account": account,
        "lost": abs(balance) + abs(unconsumed),
        "trained": trained,
        "dropped": dropped,
        "left_in_buffer": left,
        "skipped_updates": sum(e["event"] == "skipped_update" for e in events),
        "rollbacks": sum(e["event"] == "rollback" for e in events),
        "final_checkpoint_loads": loads,
        "learner_wait_max": max((r["timing/learner_wait"] for r in records[1:]), default=0.0),
        "group_bound": bound,
        "tool_failures": sum(r.get("rollout/tool_failures", 0) for r in records),
        "tool_timeouts": sum(r.get("rollout/tool_timeouts", 0) for r in records),
        "worker_restarts": last.get("ray/worker_restarts"),
    }


KILLED_RUN = "import sys\nfrom unipg.cli import main\nsys.argv = ['unipg', 'train', *sys.argv[1:]]\nmain()\n"
# KILLED_RUN whose first argument is a checkpoint step N: once checkpoint N is saved the run prints SAVED and
# waits, so that the SIGKILL lands at a known point, whatever the machine's speed
SAVED = "checkpoint saved, waiting for the SIGKILL"
PAUSED_RUN = f"""import sys, threading
from unipg.checkpoint.store import CheckpointStore
save, pause_at = CheckpointStore.save, int(sys.argv.pop(1))

def save_then_wait(self, step, *args, **kwargs):
    path = save(self, step, *args, **kwargs)
    if step == pause_at:
        print({SAVED!r}, flush=True)
        threading.Event().wait()
    return path

CheckpointStore.save = save_then_wait
{KILLED_RUN}"""


def sigkill_phase(args, output_dir: str) -> dict:
    overrides = configuration(
        args, output_dir, "reference", "deterministic=true", "checkpoint.every_updates=1", "rollback.enabled=false"
    )
    reference = text.train_lm(load_config(CONFIG, overrides)).run_dir
    rng, kills, runs, run_dir = random.Random(args.seed), 0, 0, Path(output_dir) / "killed"
    named = [o for o in overrides if not o.startswith("log.run_name=")] + ["log.run_name=killed"]
    while True:
        started = (run_dir / "checkpoints").is_dir() and CheckpointStore(run_dir / "checkpoints").latest() is not None
        if not started:  # killed before its first checkpoint: start again (a resumed run needs one)
            shutil.rmtree(run_dir, ignore_errors=True)
        pause = args.kill_at_checkpoint is not None and kills < args.kills
        command = [
            sys.executable,
            "-c",
            *([PAUSED_RUN, str(args.kill_at_checkpoint)] if pause else [KILLED_RUN]),
            *(["--resume", str(run_dir)] if started else ["--config", str(CONFIG), *named]),
        ]
        stderr_path = Path(output_dir) / f"killed-run-{runs}.stderr"  # a file: a full pipe would stall the run
        with open(stderr_path, "wb") as stderr:
            process = subprocess.Popen(
                command, stdout=subprocess.PIPE if pause else subprocess.DEVNULL, stderr=stderr, text=True
            )
        runs += 1
        if kills < args.kills:
            if pause:
                for line in process.stdout:  # until the run has saved the checkpoint (or ended: no kill)
                    if line.strip() == SAVED:
                        break
            else:
                time.sleep(rng.uniform(*args.kill_after))
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
                kills += 1
        if process.wait() == 0:
            break
        if process.returncode != -signal.SIGKILL:
            raise RuntimeError(f"the run failed: {stderr_path.read_text()[-2000:]}")
    full = load_checkpoint(CheckpointStore(reference / "checkpoints").latest()).tensors["policy"]
    resumed = load_checkpoint(CheckpointStore(run_dir / "checkpoints").latest()).tensors["policy"]
    equal = full.keys() == resumed.keys() and all(torch.equal(full[k], resumed[k]) for k in full)
    steps = [r["step"] for r in read_metrics(run_dir)]
    return {
        "phase": "sigkill",
        "kills": kills,
        "runs": runs,
        "bitwise_equal": equal,
        "steps_ok": steps == list(range(0, args.updates + 1)),
    }


def report(results: list[dict], args) -> None:
    print(
        f"\nfault rates: raise {args.raise_rate}, hang {args.hang_rate}, garbage {args.garbage_rate}, "
        f"huge {args.huge_rate}, hang through cancellation {args.hang_uncancellable_rate}; "
        f"{args.updates} updates of 64 episodes"
    )
    print(
        "| phase | survived | faults injected | episodes started / finished / requeued / failed / cancelled | "
        "lost | metrics steps | final checkpoint | longest learner wait |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["phase"] == "sigkill":
            continue
        a, faults = r["account"], ", ".join(f"{k} {v}" for k, v in sorted(r["injected"].items()))
        print(
            f"| {r['phase']} | {'yes' if r['error'] is None and r['updates'] == args.updates else 'NO'} | {faults} | "
            f"{a['started']} / {a['finished']} / {a['requeued']} / {a['failed']} / {a['cancelled']} | {r['lost']} | "
            f"{'each once' if r['steps_ok'] else 'GAP OR REPEAT'} | "
            f"{'loads' if r['final_checkpoint_loads'] else 'NO'} | {r['learner_wait_max']:.1f} s "
            f"(a hung group is cut after {r['group_bound']:.0f} s) |"
        )
    for r in results:  # a call that never ends must cost its episode the timeout, not the run its end
        if r["phase"] != "sigkill":
            met = r["injected"].get("hang_uncancellable", 0)
            finished = r["error"] is None and r["updates"] == args.updates
            print(f"{r['phase']} met calls that never end ({met}) and finished: {'yes' if met and finished else 'NO'}")
    for r in results:
        if r["phase"] != "sigkill":
            print(
                f"{r['phase']}: {r['seconds']:.0f} s; trained on {r['trained']}, "
                f"dropped/evicted/filtered {r['dropped']}, left in buffer {r['left_in_buffer']}; "
                f"tool failures {r['tool_failures']:.0f}, timeouts "
                f"{r['tool_timeouts']:.0f}; skipped updates {r['skipped_updates']}, rollbacks {r['rollbacks']}"
                + (f"; worker restarts {r['worker_restarts']:.0f}" if r["worker_restarts"] is not None else "")
                + (f"; ERROR {r['error']}" if r["error"] else "")
            )
        else:
            print(
                f"sigkill: {r['kills']} SIGKILLs over {r['runs']} runs; final weights equal to the uninterrupted "
                f"run bit for bit: {'yes' if r['bitwise_equal'] else 'NO'}; metrics steps "
                f"{'each once' if r['steps_ok'] else 'GAP OR REPEAT'}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--updates", type=int, default=16)
    parser.add_argument("--ray", action="store_true", help="also run the Ray phase")
    parser.add_argument("--skip-inprocess", action="store_true")
    parser.add_argument("--skip-sigkill", action="store_true")
    parser.add_argument("--raise-rate", type=float, default=0.1)
    parser.add_argument("--hang-rate", type=float, default=0.05)
    parser.add_argument("--garbage-rate", type=float, default=0.05)
    parser.add_argument("--huge-rate", type=float, default=0.05)
    parser.add_argument(
        "--hang-uncancellable-rate",
        type=float,
        default=0.05,
        help="calls that hang catching every cancellation (they never end; the run must not wait for them)",
    )
    parser.add_argument("--interrupt-every", type=float, default=5.0, help="seconds between cancelled groups")
    parser.add_argument("--kill-every", type=float, default=30.0, help="seconds between killed Ray workers")
    parser.add_argument("--nan-updates", type=int, nargs="*", default=[3, 9])
    parser.add_argument("--kills", type=int, default=2, help="SIGKILLs of the sigkill phase")
    parser.add_argument(
        "--kill-after",
        type=float,
        nargs=2,
        default=[20.0, 60.0],
        help="a SIGKILL comes uniformly between these seconds after a (re)start",
    )
    parser.add_argument(
        "--kill-at-checkpoint",
        type=int,
        help="instead: a SIGKILL comes as soon as the run has saved checkpoint N (1 ≤ N < --updates)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="tiny sizes, a few seconds: checks that the script still runs, measures nothing",
    )
    args = parser.parse_args()
    if args.smoke:  # one SIGKILL, right after the first update's checkpoint: the run resumes once
        args.updates, args.nan_updates, args.interrupt_every = 3, [2], 2.0
        args.kills, args.kill_at_checkpoint = 1, 1
        args.hang_uncancellable_rate = 0.3  # a few tool calls in each update, some never end
    if args.kill_at_checkpoint is not None and not 1 <= args.kill_at_checkpoint < args.updates:
        parser.error(f"--kill-at-checkpoint must be between 1 and --updates - 1 ({args.updates - 1})")
    results = []
    with tempfile.TemporaryDirectory() as output_dir:
        phases = ([] if args.skip_inprocess else ["inprocess"]) + (["ray"] if args.ray else [])
        for phase in phases:
            results.append(run_phase(args, phase, output_dir))
            print(json.dumps(results[-1], default=str), flush=True)
        if not args.skip_sigkill:
            results.append(sigkill_phase(args, output_dir))
            print(json.dumps(results[-1]), flush=True)
    report(results, args)


if __name__ == "__main__":
    main()
