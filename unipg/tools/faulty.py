"""Fault injection for tools: wrap any registered tool so that some of its calls raise, hang, return garbage
or return enormous output — to check, before a long run, that training goes on through what real tools do.

Configured like any tool::

    task:
      tools:
        - name: faulty
          options: {tool: calculator, raise_rate: 0.1, hang_rate: 0.05, garbage_rate: 0.05, huge_rate: 0.05}

The agent sees the wrapped tool's name (the name it is configured under, ``calculator`` above), description and
parameters; the wrapper is invisible to it. Each
attempt draws one uniform number from ``(seed, tool, arguments, attempt)``, where ``attempt`` is the
environment service's retry counter (``current_attempt``, set by the service), and picks a fault by the rates
in order raise, hang, garbage, huge, hang_sync, hang_uncancellable. Draws are a pure function of those, not of
a random stream, so a run resumed from a checkpoint meets exactly the faults the uninterrupted run met, and a retry of a failed call may
succeed (its draw differs). What each fault does:

- ``raise``: ``RuntimeError`` — the service retries, then gives the default observation and the penalty;
- ``hang``: sleeps ``hang_seconds`` (default an hour) — the service's timeout must cut it;
- ``hang_sync``: blocks the thread of a synchronous call for ``hang_seconds`` (with a nonzero
  ``hang_sync_rate`` the wrapped tool is synchronous, and its ``hang`` blocks too) — a stuck thread must cost
  no more than the timeout, and must not keep the process from exiting;
- ``hang_uncancellable``: sleeps ``hang_seconds`` catching every cancellation — the service must give up on
  the call at its timeout rather than wait for it, and the episodes' event loop must end without it;
- ``garbage``: returns ``None``, an object that is not JSON-serializable, or text of random bytes (lone
  surrogates and control characters included), drawn like the fault — the first two are failures, the last
  must reach the tokenizer as valid text;
- ``huge``: returns ``huge_chars`` characters (default 10 million) — the service must clip it.

``injected`` counts the faults by kind (in this process).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import threading
from collections import Counter

from unipg.tools.base import TOOLS, Tool, build_entry, current_attempt, names_its_tools

FAULT_KINDS = ("raise", "hang", "garbage", "huge")
HANG_KINDS = ("hang_sync", "hang_uncancellable")  # drawn after FAULT_KINDS, so adding them moves no draw


class InjectedFault(RuntimeError):
    """A failure the ``faulty`` tool raised on purpose."""


def attempt_random(seed: int, name: str, arguments: dict, attempt: int) -> random.Random:
    """The random stream of one attempt; str seeds hash with SHA-512, so it is the same in every process."""
    return random.Random(f"{seed}|{name}|{json.dumps(arguments, sort_keys=True, default=str)}|{attempt}")


def draw_fault(rates: dict[str, float], rng: random.Random) -> str | None:
    """The fault of one attempt (a kind of ``FAULT_KINDS`` or ``HANG_KINDS``) or None."""
    draw, edge = rng.random(), 0.0
    for kind in FAULT_KINDS + HANG_KINDS:
        edge += rates.get(kind, 0.0)
        if draw < edge:
            return kind
    return None


def garbage_output(rng: random.Random):
    """Something a broken tool might return instead of text: nothing, an object that is not JSON-serializable,
    or random bytes decoded carelessly (lone surrogates and control characters)."""
    draw = rng.random()
    if draw < 1 / 3:
        return None
    if draw < 2 / 3:
        return object()
    return rng.randbytes(64).decode("utf-8", "surrogateescape") + "\x00\x1b[2J\ud800"


@TOOLS.register("faulty")
@names_its_tools(lambda options: [options["tool"]] if isinstance(options.get("tool"), str) else None)
def faulty_tool(
    tool: str,
    options: dict | None = None,
    raise_rate: float = 0.0,
    hang_rate: float = 0.0,
    garbage_rate: float = 0.0,
    huge_rate: float = 0.0,
    hang_sync_rate: float = 0.0,
    hang_uncancellable_rate: float = 0.0,
    hang_seconds: float = 3600.0,
    huge_chars: int = 10_000_000,
    seed: int = 0,
) -> list[Tool]:
    """Tool ``tool`` (built with ``options``) whose calls fail at the given rates (module docstring); a list of
    that one tool, offered under the wrapped tool's name, not ``faulty``."""
    rates = {
        "raise": raise_rate,
        "hang": hang_rate,
        "garbage": garbage_rate,
        "huge": huge_rate,
        "hang_sync": hang_sync_rate,
        "hang_uncancellable": hang_uncancellable_rate,
    }
    _check_rates(tool, rates)
    inner = _build_one(tool, options or {})
    if hang_sync_rate and inner.is_async:
        raise ValueError(f"faulty tool: hang_sync needs a synchronous tool, and '{tool}' is async")
    return [_wrap(inner, rates, seed=seed, hang_seconds=hang_seconds, huge_chars=huge_chars)]


def _build_one(tool: str, options: dict) -> Tool:
    """The one tool that entry ``tool`` builds with ``options``; an error (its tools closed) if it builds none
    or several."""
    built = build_entry(tool, options)
    if len(built) != 1:
        for one in built:
            if one.close is not None:
                one.close()
        raise ValueError(f"faulty tool: '{tool}' builds {len(built)} tools; wrap a tool entry that builds one")
    return built[0]


def _wrap(inner: Tool, rates: dict[str, float], *, seed: int, hang_seconds: float, huge_chars: int) -> Tool:
    """``inner`` with calls that draw their fault first (synchronous calls when ``hang_sync`` has a rate), and an
    ``injected`` counter of the faults by kind."""
    injected = Counter()

    def draw(arguments: dict) -> tuple[str | None, random.Random]:
        rng = attempt_random(seed, inner.name, arguments, current_attempt())
        kind = draw_fault(rates, rng)
        if kind is not None:
            injected[kind] += 1
        if kind == "raise":
            raise InjectedFault(f"injected failure of {inner.name}")
        return kind, rng

    def call_sync(**arguments):  # a synchronous tool, so that hang_sync blocks the thread it runs on
        kind, rng = draw(arguments)
        if kind in ("hang", "hang_sync"):
            threading.Event().wait(hang_seconds)
        return _output(kind, rng, huge_chars) if kind in ("garbage", "huge") else inner.function(**arguments)

    async def call(**arguments):
        kind, rng = draw(arguments)
        if kind == "hang":
            await asyncio.sleep(hang_seconds)
        if kind == "hang_uncancellable":
            await _sleep_through_cancellation(hang_seconds)
        if kind in ("garbage", "huge"):
            return _output(kind, rng, huge_chars)
        if inner.is_async:
            return await inner.function(**arguments)
        return await asyncio.to_thread(inner.function, **arguments)

    wrapped = dataclasses.replace(inner, function=call_sync if rates["hang_sync"] else call)
    wrapped.injected = injected  # a plain attribute: the dataclass has no field for it
    return wrapped


def _check_rates(tool: str, rates: dict[str, float]) -> None:
    for kind, rate in rates.items():
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"faulty tool: {kind}_rate must be in [0, 1], got {rate}")
    if sum(rates.values()) > 1.0:
        raise ValueError(
            f"faulty tool: the fault rates add up to {sum(rates.values()):g}; they must add up to at most 1"
        )
    if rates["hang_sync"] and rates["hang_uncancellable"]:
        raise ValueError(
            "faulty tool: hang_sync (a synchronous call) and hang_uncancellable (an async call) "
            "cannot be combined in one tool; wrap the tool twice"
        )
    if tool == "faulty":
        raise ValueError("faulty tool: wrap a real tool (tool: calculator, python, search, ...), not faulty itself")


def _output(kind: str, rng: random.Random, huge_chars: int):
    return garbage_output(rng) if kind == "garbage" else "x" * huge_chars


async def _sleep_through_cancellation(seconds: float) -> None:
    """Sleep ``seconds``, catching every cancellation and sleeping on, as a badly written tool does."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    while (left := deadline - loop.time()) > 0:
        try:
            await asyncio.sleep(left)
        except asyncio.CancelledError:
            continue
