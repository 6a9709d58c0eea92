"""How an lm run stops early, and how it goes on: on a signal (Ctrl-C, SIGTERM) after its current update; after
``rollback.max_trips`` tripped updates in a row, back to its newest checkpoint with a lower learning rate; and when
rollout fails for good, with a checkpoint of the last finished update. See ``unipg.runtime.lm``."""

from __future__ import annotations

import signal
import sys
import threading
import traceback
from pathlib import Path

from unipg.checkpoint.lm import LMCheckpointer
from unipg.checkpoint.store import load_checkpoint
from unipg.config import RollbackConfig
from unipg.observe.metrics import MetricsLogger
from unipg.runtime.driver import Runtime
from unipg.runtime.replay import ProducerFailed


class TrainingStopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM stopped a run after an update, and a checkpoint of that update was saved."""

    def __init__(self, run_dir: Path, update: int, signal_number: int):
        super().__init__(f"stopped after update {update}; continue with: unipg train --resume {run_dir}")
        self.run_dir, self.update, self.signal_number = run_dir, update, signal_number


class StopRequest:
    """Within ``with``: the first SIGINT or SIGTERM asks the run to stop after its current update (so that the
    checkpoint is of a whole update); a second SIGINT raises ``KeyboardInterrupt`` at once, saving nothing.

    Signal handlers can only be installed in the main thread; elsewhere signals keep their usual effect.
    """

    def __init__(self):
        self.signal_number: int | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGINT, signal.SIGTERM):
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def _handle(self, number: int, frame) -> None:
        if self.signal_number is not None and number == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_number = number
        print(
            f"\n{signal.Signals(number).name}: stopping after the current update to save a checkpoint "
            "(Ctrl-C again stops at once, without saving)",
            file=sys.stderr,
            flush=True,
        )


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


def rollout_failed(
    failure: ProducerFailed,
    checkpointer: LMCheckpointer,
    update: int,
    saved: int | None,
    samples: int,
    train_seconds: float,
    history: list,
    episodes: dict[str, int] | None,
) -> str:
    """After rollout failed for good: save a checkpoint of the last finished ``update`` (with ``episodes``, the
    episode counts as of it) unless ``saved`` is it, and the failure's whole traceback to
    ``run_dir/rollout_error.txt``; the one-line message of the run's end, saying where to continue from."""
    run_dir = checkpointer.store.root.parent
    if update > 0 and saved != update:
        checkpointer.save(
            update, samples=samples, train_seconds=train_seconds, history=history, metrics={}, episodes=episodes
        )
        saved = update
    trace = run_dir / "rollout_error.txt"  # the message is one line; the traceback is what debugging needs
    trace.write_text("".join(traceback.format_exception(failure)), encoding="utf-8")
    where = (
        f"a checkpoint of update {saved} is in {run_dir}; continue with: unipg train --resume {run_dir}"
        if saved
        else f"no update had finished; the metrics so far are in {run_dir}"
    )
    return f"{failure}; {where} (traceback: {trace})"


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
