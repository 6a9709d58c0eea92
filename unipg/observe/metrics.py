"""One metrics stream: JSONL always, TensorBoard and Weights & Biases optionally, live diagnosis, and a
terminal progress display.

Metric names are namespaced (``train/``, ``eval/``, ``rollout/``, ``timing/``). ``metrics.jsonl`` holds one
JSON object per line: ``{"step": <env steps>, "time": <seconds since start>, "<name>": <value>, ...}``.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import yaml

from unipg.observe.records import finite_or_none, read_metrics  # noqa: F401  (re-exported)


class MetricsLogger:
    """Appends metrics to ``run_dir/metrics.jsonl`` and, if enabled, TensorBoard event files.

    ``write_config`` records the run's settings and starts what needs them: a Weights & Biases run when
    ``log.wandb`` is set (``log.wandb_mode: offline`` writes under ``run_dir/wandb`` with no network; upload it
    later with ``wandb sync``), and the live ``doctor`` checks when ``log.monitor`` is set, whose warnings go to
    ``warn`` (standard error by default) and to ``run_dir/events.jsonl``.
    """

    def __init__(self, run_dir: Path, *, tensorboard: bool = True, warn=None):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.start = time.time()
        self._jsonl = (self.run_dir / "metrics.jsonl").open("a", encoding="utf-8")
        self._wandb = None
        self._monitor = None
        self._warn = warn or (lambda text: print(text, file=sys.stderr, flush=True))
        self._tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import (
                SummaryWriter,  # lazy: TensorBoard is slow to import
            )

            self._tensorboard = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {key: finite_or_none(value) for key, value in metrics.items()}
        record = {"step": int(step), "time": round(time.time() - self.start, 3), **clean}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for key, value in clean.items():
                if value is not None:
                    self._tensorboard.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({key: value for key, value in clean.items() if value is not None}, step=int(step))
        if self._monitor is not None:
            for finding in self._monitor.observe(step, clean):
                self.event(
                    step,
                    "diagnosis",
                    warning=f"doctor {finding.severity}: {finding.check}: {finding.evidence} — {finding.remedy}",
                    **finding.to_dict(),
                )

    def transcripts(self, step: int, records: list[dict], *, kind: str = "eval") -> Path:
        """Write episode transcripts (``unipg.sample.transcripts``) to ``run_dir/transcripts/<kind>_<step>.jsonl``,
        one per line, and to TensorBoard as text (tag ``<kind>/transcripts``); the file's path."""
        from unipg.sample.transcripts import format_transcript

        folder = self.run_dir / "transcripts"
        folder.mkdir(exist_ok=True)
        path = folder / f"{kind}_{int(step)}.jsonl"
        path.write_text("".join(json.dumps(record, default=str) + "\n" for record in records), encoding="utf-8")
        if self._tensorboard is not None and records:
            text = "\n\n".join("```\n" + format_transcript(record) + "\n```" for record in records)
            self._tensorboard.add_text(f"{kind}/transcripts", text, int(step))
        return path

    def event(self, step: int, event: str, *, warning: str | None = None, **fields) -> None:
        """Append ``{"step", "event", **fields}`` to ``run_dir/events.jsonl``; show ``warning`` if given."""
        if warning is not None:
            self._warn(warning)
        with self.events_path.open("a", encoding="utf-8") as events:
            events.write(json.dumps({"step": int(step), "event": event, **fields}) + "\n")

    @property
    def events_path(self) -> Path:
        return self.run_dir / "events.jsonl"

    def write_config(self, config: dict) -> None:
        """The resolved configuration the run used, for reproduction (``unipg train --config`` reads it).

        Secrets (values under keys such as ``WANDB_API_KEY`` or ``api_token``) are saved as ``<redacted>``; a
        run resumed from this file reads them from the environment or from overrides again."""
        from unipg.config.secrets import redact_secrets

        config = redact_secrets(config)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        if self._tensorboard is not None:
            self._tensorboard.add_text("config", "```\n" + yaml.safe_dump(config, sort_keys=False) + "\n```")
        log = config.get("log", {})
        if log.get("wandb") and self._wandb is None:
            self._wandb = start_wandb(self.run_dir, config)
        if log.get("monitor") and self._monitor is None:
            from unipg.observe.doctor import Monitor

            self._monitor = Monitor(config=config)

    def close(self) -> None:
        self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            import wandb

            self._wandb.finish()
            wandb.teardown()  # stop W&B's background service: a finished run leaves no process behind
            self._wandb = None


def start_wandb(run_dir: Path, config: dict):
    """A Weights & Biases run for this run folder, with the whole configuration as its hyperparameters."""
    try:
        import wandb
    except ImportError as error:
        raise ValueError(
            "log.wandb is set but wandb is not installed: pip install 'unipg[wandb]' (or set log.wandb=false)"
        ) from error
    from unipg.config.secrets import redact_secrets

    log = config.get("log", {})
    # x_disable_meta: W&B's run metadata holds the command line, where a secret passed as an override
    # (ray.runtime_env.env_vars.HF_TOKEN=...) would be saved with the run and uploaded with it
    return wandb.init(
        project=log.get("wandb_project") or "unipg",
        name=Path(run_dir).name,
        dir=str(run_dir),
        mode=log.get("wandb_mode", "offline"),
        config=redact_secrets(config),
        reinit="create_new",
        settings=wandb.Settings(x_disable_meta=True),
    )


class Timer:
    """Accumulates wall time per phase: ``with timer("rollout"): ...``; ``pop()`` returns timing/<phase>."""

    def __init__(self):
        self.totals: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.totals[phase] = self.totals.get(phase, 0.0) + time.perf_counter() - start

    def pop(self) -> dict[str, float]:
        totals, self.totals = self.totals, {}
        return {f"timing/{phase}": seconds for phase, seconds in totals.items()}


class Progress:
    """A rich progress bar with the latest return on a terminal; a plain line per update otherwise."""

    def __init__(self, total_steps: int, *, enabled: bool = True, description: str = "train"):
        self.total, self.enabled = total_steps, enabled
        self.interactive = enabled and sys.stdout.isatty()
        self.description = description
        self._last_plain = 0.0
        self._bar = None
        if self.interactive:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
            )
            self._task = self._bar.add_task(description, total=total_steps, status="")
            self._bar.start()

    def update(self, step: int, status: str) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=status)
        elif self.enabled and (time.time() - self._last_plain > 5.0 or step >= self.total):
            self._last_plain = time.time()
            print(f"[{self.description}] step {step}/{self.total} {status}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


@functools.lru_cache(maxsize=1)
def _libc():
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (macOS, musl): nothing to trim
        return None


def release_free_memory() -> None:
    """Return memory that Python and torch have freed to the operating system (glibc's ``malloc_trim``).

    glibc keeps freed heap pages for reuse, so a run that allocates tensors of changing shapes shows a resident
    size that drifts upwards although nothing leaks (a 15-minute soak: 1.1 → 1.5 GB resident, 0.5–0.8 GB after a
    trim, the same number of live Python objects throughout). Trimming once per update keeps
    ``system/rss_mb`` close to the memory in use, so that a real leak stands out."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter for the most malloc arenas a process creates (malloc.h)."""


def limit_malloc_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas at ``arenas`` for this process and the processes it starts (Ray workers, seed
    jobs), unless the environment already sets a cap (``MALLOC_ARENA_MAX``, or ``glibc.malloc.arena_max`` in
    ``GLIBC_TUNABLES``); whether this call set it. Call it before the process starts threads: arenas that
    threads already hold stay.

    glibc gives threads that allocate at the same time arenas of their own, up to eight per core, and keeps each
    arena's freed pages: as a thread pool of tool calls fills, resident memory creeps up without a leak (``benchmarks/soak.py``
    measures it with and without the cap). The ``unipg`` command calls it first thing; a program that
    embeds unipg decides for itself (``MALLOC_ARENA_MAX=2`` in its environment does the same)."""
    import os

    if "MALLOC_ARENA_MAX" in os.environ or "glibc.malloc.arena_max" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt") or libc.mallopt(M_ARENA_MAX, arenas) != 1:
        return False
    os.environ["MALLOC_ARENA_MAX"] = str(arenas)  # child processes read it at start
    return True


def quiet_libraries() -> None:
    """Keep transformers' per-file progress bars and advisory warnings out of the run's output."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def process_metrics() -> dict[str, float]:
    """This process's resident memory (MB), open file descriptors and threads, for spotting leaks in long runs
    (``doctor`` flags a memory metric that keeps rising). Linux ``/proc``; empty elsewhere."""
    import os
    import threading

    try:
        with open("/proc/self/statm", encoding="ascii") as statm:
            resident_pages = int(statm.read().split()[1])
        open_files = len(os.listdir("/proc/self/fd"))
        threads = len(os.listdir("/proc/self/task"))  # native threads too (torch, tokenizers), not only Python's
    except (OSError, ValueError, IndexError):
        return {}
    return {
        "system/rss_mb": resident_pages * os.sysconf("SC_PAGE_SIZE") / 2**20,
        "system/open_files": open_files,
        "system/threads": threads,
        "system/python_threads": threading.active_count(),
    }
