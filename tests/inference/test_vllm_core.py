"""The engines of one process take turns in vLLM: vLLM keeps state per process (its forward context, its CPU
kernels' buffers), and two engines stepping at once (a model per role runs an engine per role) handed one engine's
state to the other: NaN log-probs from the checker's engine, "Forward context is not set", or a corrupt heap."""

import threading
from types import SimpleNamespace

from unipg.inference.vllm_core import StepLoop

# How long the first engine, inside its step, gives the second to step too. With the engines taking turns the second
# can never step then, so the test's outcome does not depend on this; without it the second steps within it.
OVERLAP_WINDOW_S = 0.5


class OneStepEngine:
    """A stand-in for vLLM's ``LLMEngine``: every request finishes at its first step. ``hold`` (optional) runs inside
    the step, before it returns."""

    def __init__(self, entered: threading.Event, hold=None):
        self.entered, self.hold, self.requests = entered, hold, []

    def add_request(self, request_id, prompt, params, lora_request=None):
        self.requests.append(request_id)

    def abort_request(self, request_ids):
        pass

    def step(self):
        self.entered.set()
        if self.hold is not None:
            self.hold()
        requests, self.requests = self.requests, []
        return [SimpleNamespace(request_id=request_id, finished=True) for request_id in requests]


def test_two_engines_of_one_process_never_step_at_once():
    first_in, second_in, answered = threading.Event(), threading.Event(), []
    overlapped = []  # whether the second engine stepped while the first was inside its step
    first = StepLoop(OneStepEngine(first_in, hold=lambda: overlapped.append(second_in.wait(OVERLAP_WINDOW_S))))
    second = StepLoop(OneStepEngine(second_in))
    done = threading.Event()

    def answer(output, error):
        answered.append(error)
        if len(answered) == 2:
            done.set()

    try:
        first.submit([1, 2], None, answer)
        assert first_in.wait(60)
        second.submit([3, 4], None, answer)  # while the first engine is inside its step
        assert done.wait(60)
    finally:
        first.close()
        second.close()
    assert overlapped == [False]  # the second engine stepped only once the first had left its step
    assert second_in.is_set() and answered == [None, None]


def test_aborting_a_request_after_the_engine_closed_does_nothing():
    loop = StepLoop(OneStepEngine(threading.Event()))
    loop.close()
    loop.abort("0")  # a cancelled episode's request, after the run closed its engine: no error
