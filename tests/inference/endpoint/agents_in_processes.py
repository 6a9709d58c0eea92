"""One external agent for the worker-process tests: what it does is named by its example's ``columns["act"]``,
so that one worker process (started once for the module) plays every case."""

import asyncio
import os
from pathlib import Path

from tests.inference.endpoint import agents_for_tests as agents


async def acts(base_url, api_key, example):
    act = example.columns.get("act")  # none (a task's own example): two turns
    if act == "log_probs":
        return await agents.reports_its_log_probs(base_url, api_key, example)
    if act == "raises":
        raise RuntimeError("agent bug")
    if act == "hangs":
        await asyncio.Event().wait()
    if act == "unpicklable":
        await agents.rewards_itself(base_url, api_key, example)
        return {"answer": "6", "extra": lambda: None}
    if act == "dies_once":  # the worker exits the first time only: the file says it has died before
        marker = Path(example.columns["marker"])
        if not marker.exists():
            marker.write_text("died")
            os._exit(3)
    return await agents.two_turns(base_url, api_key, example)
