"""How an lm run stops early, and how it goes on: on a signal (Ctrl-C, SIGTERM) after its current update, or, when
that update does not finish within ``STOP_GRACE_SECONDS``, at once with the checkpoint of the last finished one;
after ``rollback.max_trips`` tripped updates in a row, back to its newest checkpoint with a lower learning rate; and
when rollout fails for good, with a checkpoint of the last finished update. See ``unipg.runtime.lm``."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unipg.checkpoint.lm import LMCheckpointer
from unipg.checkpoint.store import load_checkpoint
from unipg.config import RollbackConfig
from unipg.config.timeouts import WaitTimeout
from unipg.learn.state import generator_state, restore_generator, restore_rng, rng_state
from unipg.observe.metrics import MetricsLogger
from unipg.runtime.driver import EpisodeAccount, Runtime
from unipg.runtime.replay import ProducerFailed

# Seconds a run asked to stop (Ctrl-C, SIGTERM) gives its current update to finish. Past them, a rollout or an
# evaluation still running is given up and the run stops with the checkpoint of the last finished update: short
# enough to end inside the usual notice before a SIGKILL (30 s for Kubernetes and Slurm).
STOP_GRACE_SECONDS = 20.0
# Seconds after the signal at which the process exits whatever it is doing (status 128 + the signal's number),
# keeping the checkpoints saved before: the bound for a run stuck where nothing can be given up (learning, saving).
STOP_EXIT_SECONDS = 60.0


class TrainingStopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run after an update, and a checkpoint of that update was saved."""

    def __init__(self, run_dir: Path, update: int, signal_number: int):
        super().__init__(f"stopped after update {update}; continue with: unipg train --resume {run_dir}")
        self.run_dir, self.update, self.signal_number = run_dir, update, signal_number


class UpdateAbandoned(KeyboardInterrupt):
    """The update in progress was given up: a stop was asked for and its rollout did not end within the grace.

    A ``KeyboardInterrupt``, so that it leaves an event loop (asyncio passes those on, where it keeps other
    exceptions inside the task that raised them) and no ``except Exception`` on its way swallows it. It carries
    the number of the signal that asked for the stop (the exit status is 128 plus it)."""

    def __init__(self, signal_number: int = signal.SIGINT):
        super().__init__(signal_number)
        self.signal_number = signal_number


class StopRequest:
    """Within ``with``: the first SIGINT or SIGTERM asks the run to stop after its current update (so that the
    checkpoint is of a whole update); a second SIGINT raises ``KeyboardInterrupt`` at once, saving nothing.

    When the current update has not finished ``grace`` seconds after the first signal, the main thread is
    interrupted: inside ``abandonable`` (waiting for rollout, evaluating) it raises ``UpdateAbandoned``, and the
    run saves the last finished update and stops; elsewhere the run goes on. A run still inside the ``with`` block
    ``exit_after`` seconds after the signal exits at once with status 128 + the signal's number.

    Signal handlers can only be installed in the main thread; elsewhere signals keep their usual effect.
    """

    def __init__(self, grace: float | None = None, exit_after: float | None = None):
        """``grace``, ``exit_after``: seconds (None: ``STOP_GRACE_SECONDS``, ``STOP_EXIT_SECONDS``)."""
        self.grace = STOP_GRACE_SECONDS if grace is None else grace
        self.exit_after = STOP_EXIT_SECONDS if exit_after is None else exit_after
        self.signal_number: int | None = None
        self.overdue = threading.Event()  # the grace has passed with the run still going
        self._previous: dict[int, object] = {}
        self._abandonable = False
        self._timers: list[threading.Timer] = []
        self._lock = threading.Lock()  # the timers act only while the handlers are installed
        self._main = threading.main_thread().ident

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        with self._lock:
            for timer in self._timers:
                timer.cancel()
            for number, handler in self._previous.items():
                signal.signal(number, handler)
            self._previous = {}

    @contextlib.contextmanager
    def abandonable(self):
        """A part of a run that may be given up (waiting for rollout, evaluating): past the grace,
        ``UpdateAbandoned`` is raised in it, or on entering it."""
        if self.overdue.is_set():
            raise UpdateAbandoned(self.signal_number)
        self._abandonable = True
        try:
            if self.overdue.is_set():  # the grace passed just before: its signal found nothing to give up
                raise UpdateAbandoned(self.signal_number)
            yield
        finally:
            self._abandonable = False

    def _handle(self, number: int, frame) -> None:
        if self.overdue.is_set():  # the grace has passed: the timer's SIGTERM, or the user's next signal
            if self._abandonable:
                raise UpdateAbandoned(self.signal_number)
            if number == signal.SIGINT:
                raise KeyboardInterrupt
            return
        if self.signal_number is not None:
            if number == signal.SIGINT:
                raise KeyboardInterrupt
            return
        self.signal_number = number
        print(
            f"\n{signal.Signals(number).name}: stopping after the current update to save a checkpoint; if it has "
            f"not finished in {self.grace:g} s, stopping with the last finished update's checkpoint "
            "(Ctrl-C again stops at once, without saving)",
            file=sys.stderr,
            flush=True,
        )
        for seconds, then in ((self.grace, self._give_up_update), (self.exit_after, self._exit_now)):
            timer = threading.Timer(seconds, then)
            timer.daemon = True
            timer.start()
            self._timers.append(timer)

    def _give_up_update(self) -> None:
        """On the timer's thread, ``grace`` after the first signal: interrupt the main thread (``_handle``)."""
        with self._lock:
            if not self._previous:  # the run has left the ``with`` block
                return
            self.overdue.set()
            print(
                f"the current update did not finish within {self.grace:g} s of the "
                f"{signal.Signals(self.signal_number).name}; giving it up",
                file=sys.stderr,
                flush=True,
            )
            signal.pthread_kill(self._main, signal.SIGTERM)  # a real signal: it wakes a blocked wait

    def _exit_now(self) -> None:
        with self._lock:
            if not self._previous:
                return
            print(
                f"the run did not stop within {self.exit_after:g} s of the {signal.Signals(self.signal_number).name}; "
                "exiting now without saving anything more",
                file=sys.stderr,
                flush=True,
            )
            os._exit(128 + self.signal_number)


@dataclass
class RolloutPosition:
    """Where a run stood before an update's rollout began: its prompt order, its rollout generator and the
    process's random generators. A run that gives the update up saves these, as if it had never begun, so that
    it resumes as the run would have gone on."""

    sampler: dict
    generator: str
    rng: dict

    @classmethod
    def of(cls, checkpointer: LMCheckpointer) -> RolloutPosition:
        return cls(checkpointer.sampler.state(), generator_state(checkpointer.generator), rng_state())

    def restore(self, checkpointer: LMCheckpointer) -> None:
        checkpointer.sampler.load_state(self.sampler)
        restore_generator(checkpointer.generator, self.generator)
        restore_rng(self.rng)


def update_abandoned(run: Any, update: int, signal_number: int, position: RolloutPosition | None) -> TrainingStopped:
    """After what followed ``update`` was given up (``UpdateAbandoned``): rollout stopped, a checkpoint of ``update``
    (the last finished one; 0: the weights training started from) saved unless ``run.saved`` is it, from
    ``position`` when the next update's rollout had begun; the ``TrainingStopped`` to raise."""
    run.runtime.close()  # rollout stops before its prompt order is set back
    if run.saved != update:
        if position is not None:
            position.restore(run.checkpointer)
        run.checkpointer.save(
            update,
            samples=run.samples,
            train_seconds=run.train_seconds,
            history=run.history,
            metrics={},
            episodes=run.episode_counts if run.episode_counts is not None else EpisodeAccount().state(),
        )
        run.saved = update
    print(f"stopped with the checkpoint of update {update} in {run.run_dir}", file=sys.stderr, flush=True)
    return TrainingStopped(run.run_dir, update, signal_number)


class TripCounter:
    """Counts consecutive tripped updates and records them and rollbacks as events of the run's logger."""

    def __init__(self, logger: MetricsLogger, settings: RollbackConfig, target_kl: float | None):
        self.logger, self.settings, self.target_kl = logger, settings, target_kl
        self.trips, self.rollbacks = 0, 0

    def observe(self, update: int, record: dict[str, float]) -> bool:
        """Count ``update`` by its metrics (``train/skipped_steps``, ``train/reverted``); whether the run must
        now roll back."""
        reasons = []
        if record.get("train/skipped_steps", 0.0) > 0:
            reasons.append(
                f"{record['train/skipped_steps']:.0f} optimizer step(s) with a non-finite loss or gradient norm skipped"
            )
        if record.get("train/reverted", 0.0) > 0:
            reasons.append(
                f"approx KL {record['train/approx_kl']:.3g} beyond {self.settings.kl_multiple:g} × "
                f"target_kl {self.target_kl:g}, update reverted"
            )
        if not reasons:
            self.trips = 0
            return False
        self.trips += 1
        reason = "; ".join(reasons)
        self.logger.event(
            update,
            "skipped_update",
            reason=reason,
            trips=self.trips,
            warning=f"warning: update {update} tripped ({self.trips} of {self.settings.max_trips} in a row): {reason}",
        )
        return self.trips >= self.settings.max_trips

    def rolled_back(self, update: int, to_update: int, learning_rate_factor: float) -> None:
        """Record a rollback at ``update`` to the checkpoint of ``to_update``, and start counting afresh.

        Raises ValueError once the run has rolled back more than ``max_rollbacks`` times: it keeps diverging
        at ever smaller learning rates, so something other than the step size is wrong.
        """
        self.trips, self.rollbacks = 0, self.rollbacks + 1
        if self.rollbacks > self.settings.max_rollbacks:
            self.logger.event(update, "gave_up", rollbacks=self.rollbacks - 1)
            raise ValueError(
                f"updates keep tripping after {self.rollbacks - 1} rollbacks (learning rate now × "
                f"{learning_rate_factor / self.settings.lr_factor:g}); see {self.logger.events_path} — "
                "check the rewards for non-finite values, or lower train.learning_rate"
            )
        self.logger.event(
            update,
            "rollback",
            to_update=to_update,
            learning_rate_factor=learning_rate_factor,
            warning=f"warning: {self.settings.max_trips} tripped updates in a row; rolled back to "
            f"update {to_update} with the learning rate × {learning_rate_factor:g}",
        )


def rollout_failed(failure: ProducerFailed, run: Any, update: int) -> str:
    """After rollout failed for good: save a checkpoint of the last finished ``update`` (with the episode counts as
    of it) unless ``run.saved`` is it, and the failure's whole traceback to ``run_dir/rollout_error.txt``; the
    one-line message of the run's end, saying where to continue from."""
    run_dir, saved = run.run_dir, run.saved
    if update > 0 and saved != update:
        run.checkpointer.save(
            update,
            samples=run.samples,
            train_seconds=run.train_seconds,
            history=run.history,
            metrics={},
            episodes=run.episode_counts,
        )
        saved = run.saved = update
    trace = run_dir / "rollout_error.txt"  # the message is one line; the traceback is what debugging needs
    trace.write_text("".join(traceback.format_exception(failure)), encoding="utf-8")
    where = (
        f"a checkpoint of update {saved} is in {run_dir}; continue with: unipg train --resume {run_dir}"
        if saved
        else f"no update had finished; the metrics so far are in {run_dir}"
    )
    return f"{failure}; {where} (traceback: {trace})"


def waited_too_long(timeout: WaitTimeout, run: Any) -> WaitTimeout:
    """After a wait of the run's learning, saving or evaluating outlived its setting: the error to raise, saying
    which checkpoint the run continues from (the newest one: learner ranks that do not answer can write none). One
    that ``rollout_failed`` already placed after a checkpoint it saved comes back as it is."""
    if isinstance(timeout.__cause__, ProducerFailed):
        return timeout
    where = (
        f"the newest checkpoint, of update {run.saved}, is in {run.run_dir}; continue with: unipg train --resume "
        f"{run.run_dir}"
        if run.saved is not None
        else f"no checkpoint was saved yet; the metrics so far are in {run.run_dir}"
    )
    return WaitTimeout(f"{timeout}; {where}")


def roll_back(update: int, checkpointer: LMCheckpointer, runtime: Runtime, trips: TripCounter) -> tuple[int, int, list]:
    """After ``update`` tripped ``rollback.max_trips`` times in a row: stop rollout, restore the newest intact
    checkpoint with the learning rate lowered by ``rollback.lr_factor``, restart rollout from it. The checkpoint's
    update, and the samples and evaluation history as of it."""
    learner = checkpointer.learner
    factor = learner.lr_factor * trips.settings.lr_factor
    latest = checkpointer.store.latest()
    if latest is None:
        raise ValueError(
            f"updates keep tripping and no intact checkpoint is left in {checkpointer.store.root} to "
            f"roll back to; see {trips.logger.events_path}"
        )
    good = load_checkpoint(latest)
    runtime.close()  # rollout stops before its prompt order and weights are set back
    samples, _, history = checkpointer.restore(good)
    learner.lr_factor = factor
    trips.rolled_back(update, good.step, factor)
    runtime.reset(good.step)
    return good.step, samples, history
