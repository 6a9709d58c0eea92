"""Acceptance check of unipg's GPU paths: each path of ``benchmarks/gpu_paths.py`` once, in a process of its own
under a timeout (a hang or a crash ends that path only), one line per path, then a summary line; the exit status
is 1 if a path FAILed, else 0.

    python benchmarks/gpu_check.py                        # every path on CUDA; without a CUDA device, all SKIP
    python benchmarks/gpu_check.py --device cuda:1        # the one-GPU paths on GPU 1
    python benchmarks/gpu_check.py --device cpu           # the same code on the CPU, where the mechanism allows
    python benchmarks/gpu_check.py --only hf-generate,train-2-updates

Lines: ``PASS <path> <figure>``, ``FAIL <path> <one-line reason>``, ``SKIP <path> <reason>`` (no CUDA device, too
few GPUs, a package that is not installed, or the time budget spent). Each path's output is kept in a log file
named after it (the summary line says where). Nothing is downloaded: run it with the network off.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from gpu_paths import PATHS, ROOT, skip_reason

DEFAULT_BUDGET = 570  # seconds for all paths together: the whole check fits in 10 minutes
MIN_PATH_SECONDS = 30  # a path is not started with less time left than this
DEVICE = re.compile(r"cpu|cuda(:\d+)?")
SMOKE_PATH = "hf-generate"

# every child runs offline and reports nothing home
CHILD_ENVIRONMENT = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONUNBUFFERED": "1",
}


def child_command(name: str, device: str, model: str) -> tuple[list[str], dict[str, str]]:
    """The command and environment of path ``name``'s process. ``cuda:N`` becomes ``cuda`` with only GPU N
    visible (vLLM always takes the process's first GPU); a path that needs several GPUs sees them all."""
    environment = {
        **os.environ,
        **CHILD_ENVIRONMENT,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    if device.startswith("cuda:") and PATHS[name].gpus == 1:
        environment["CUDA_VISIBLE_DEVICES"] = device.partition(":")[2]
    child_device = "cpu" if device == "cpu" else "cuda"
    script = Path(__file__).with_name("gpu_paths.py")
    return [sys.executable, str(script), name, "--device", child_device, "--model", model], environment


def run_child(name: str, device: str, model: str, timeout: float, log: Path) -> str:
    """Path ``name``'s line from its own process, or a FAIL line saying how the process ended without one."""
    command, environment = child_command(name, device, model)
    with open(log, "w") as out:
        process = subprocess.Popen(
            command, cwd=ROOT, env=environment, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            code = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # the path's own helpers too (vLLM, Ray, learner ranks)
            process.wait()
            return f"FAIL {name} timed out after {timeout:.0f} s (log: {log})"
    lines = log.read_text(errors="replace").splitlines()
    results = [line for line in lines if line.split(" ", 2)[:2] in (["PASS", name], ["FAIL", name], ["SKIP", name])]
    if results:
        return results[-1]
    last = next((line.strip() for line in reversed(lines) if line.strip()), "no output")
    return f"FAIL {name} exited {code} without a result: {last[:200]} (log: {log})"


def path_skip_reason(name: str, device: str) -> str | None:
    """Why path ``name`` cannot run on ``device`` here (``gpu_paths.skip_reason``, and a ``cuda:N`` this machine
    lacks); None if it can."""
    index = int(device.partition(":")[2] or 0)
    if device.startswith("cuda:") and torch.cuda.is_available() and index >= torch.cuda.device_count():
        return f"no CUDA device {index} (this machine has {torch.cuda.device_count()})"
    return skip_reason(name, "cpu" if device == "cpu" else "cuda")


def selected_paths(only: str | None) -> list[str]:
    if not only:
        return list(PATHS)
    names = [name.strip() for name in only.split(",") if name.strip()]
    unknown = [name for name in names if name not in PATHS]
    if unknown:
        raise ValueError(f"--only: unknown path '{unknown[0]}'; the paths are: {', '.join(PATHS)}")
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument("--only", help="comma-separated paths to run, of: " + ", ".join(PATHS))
    parser.add_argument("--model", default="embedded", help="a model name or local folder (nothing downloads)")
    parser.add_argument("--budget", type=float, default=DEFAULT_BUDGET, help="seconds for all paths together")
    parser.add_argument("--logs", type=Path, help="folder for each path's log (default: a new temporary folder)")
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE_PATH} on the CPU: a check that the script runs")
    args = parser.parse_args()
    if args.smoke:
        args.device, args.only = "cpu", SMOKE_PATH
    if not DEVICE.fullmatch(args.device):
        parser.error(f"--device '{args.device}' is not a device; use cuda, cuda:N or cpu")
    try:
        names = selected_paths(args.only)
    except ValueError as error:
        parser.error(str(error))
    start, counts = time.perf_counter(), {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for name in names:
        reason = path_skip_reason(name, args.device)
        left = args.budget - (time.perf_counter() - start)
        if reason is None and left < MIN_PATH_SECONDS:
            reason = f"the check's {args.budget:.0f} s budget is spent (rerun it with --only {name})"
        if reason is not None:
            line = f"SKIP {name} {reason}"
        else:
            args.logs = args.logs or Path(tempfile.mkdtemp(prefix="unipg-gpu-check-"))
            args.logs.mkdir(parents=True, exist_ok=True)
            line = run_child(name, args.device, args.model, min(PATHS[name].timeout, left), args.logs / f"{name}.log")
        counts[line.split(" ", 1)[0]] += 1
        print(line, flush=True)
    where = f"; logs in {args.logs}" if args.logs else ""
    print(
        f"summary: {counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['SKIP']} SKIP on {args.device} in "
        f"{time.perf_counter() - start:.0f} s{where}"
    )
    sys.exit(1 if counts["FAIL"] else 0)


if __name__ == "__main__":
    main()
