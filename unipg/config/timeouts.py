"""The error of a wait that outlived the setting bounding it: a learner rank that does not answer, an inference
engine's thread that makes no progress, a rollout thread that writes no group. docs/robustness.md lists the waits
and their settings."""

from __future__ import annotations


class WaitTimeout(TimeoutError):
    """A wait on another process or thread outlived the setting that bounds it; the message says what was waited on
    and where (which rank, which thread), for how long, and which setting to raise.

    A ``TimeoutError``, hence an ``OSError``: the command line prints it as one ``error:`` paragraph, without a
    traceback, and exits with status 2."""

    @classmethod
    def after(cls, waited_on: str, seconds: float, setting: str, hint: str = "") -> WaitTimeout:
        """``"<waited_on> within <setting>=<seconds> s: <hint>"``.

        >>> str(WaitTimeout.after("learner rank 1 of 2 did not answer 'update'", 1800, "train.learner_timeout"))
        "learner rank 1 of 2 did not answer 'update' within train.learner_timeout=1800 s"
        """
        return cls(f"{waited_on} within {setting}={seconds:g} s" + (f": {hint}" if hint else ""))
