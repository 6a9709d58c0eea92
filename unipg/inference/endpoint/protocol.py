"""The OpenAI requests the endpoint accepts, and how it answers them from the inference engine.

A request field the endpoint cannot honour is refused (HTTP 400 naming the field) rather than ignored:
an agent that asks for ``top_logprobs`` and silently gets something else would train on a
distribution it did not ask for. Fields that change nothing here (``user``, ``metadata``, ``store``,
``parallel_tool_calls``) are accepted. A ``seed`` is honoured: each choice is sampled from a seed drawn from it
(``choice_seeds``), by a generator of its own, so the same body with the same seed gets the same reply whatever
the engine batches it with (on the same weights and engine). A ``response_format`` of JSON is honoured by
constrained decoding (``response_format``).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from unipg.config.sampling import SAMPLING_CHECKS, check_stop
from unipg.inference import HFService, SamplingParams, TurnOutput
from unipg.inference.endpoint.render import (
    RequestError,
    ToolCallFormat,
    check_tools,
    openai_tool_calls,
    plain_messages,
    render_conversation,
    reply_key,
    tool_call_format,
)
from unipg.inference.endpoint.response_format import response_schema
from unipg.inference.endpoint.sessions import Context, Session, tokenize
from unipg.inference.endpoint.tool_choice import ForcedCall, forced_call

MAX_STOP_STRINGS = 16  # OpenAI takes 4; each is searched for at every sampled token of the whole batch
MAX_STOP_LENGTH = 1000  # characters of one stop string


class _Request(BaseModel):
    # allow_inf_nan=False: NaN and Infinity (which Python's JSON reads) are no sampling parameter
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # OpenAI's range: a 64-bit integer
    stop: str | list[str] | None = None
    stream: Literal[False] | None = None  # text completions are not streamed
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    frequency_penalty: Literal[0, 0.0] | None = None  # accepted only when it changes nothing
    presence_penalty: Literal[0, 0.0] | None = None

    @field_validator("temperature", "top_p")
    @classmethod
    def _samplable(cls, value, info: ValidationInfo):
        """The check the run's ``sample`` settings pass too (unipg.config.sampling)."""
        return value if value is None else SAMPLING_CHECKS[info.field_name](value)

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop):
        strings = [stop] if isinstance(stop, str) else stop
        if strings is not None:
            check_stop(strings)
            if len(strings) > MAX_STOP_STRINGS or any(len(text) > MAX_STOP_LENGTH for text in strings):
                raise ValueError(
                    f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LENGTH} characters each"
                )
        return stop


class ChatRequest(_Request):
    stream: bool | None = None  # the whole reply is generated, then sent as chunks (``stream_chunks``)
    stream_options: dict[str, bool] | None = None  # {include_usage: true}
    messages: list[dict[str, Any]] = Field(..., min_length=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # its forms are checked by ``tool_choice.forced_call``
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: Literal[0] | None = None  # alternatives to the sampled token are not computed
    response_format: Any = None  # its forms are checked by ``response_format.response_schema``


class CompletionRequest(_Request):
    prompt: str | list[int] = Field(..., min_length=1)
    logprobs: Literal[0] | None = None  # log-probs of the sampled tokens; alternatives are not computed
    echo: Literal[False] | None = None


@dataclass
class Limits:
    """Bounds on what one request may ask for."""

    max_tokens: int  # generated tokens per choice; a larger max_tokens is cut to this
    max_n: int = 16  # choices per request
    context_length: int | None = None  # the model's: prompt and reply together never pass it


class Completions:
    """Answers chat and text completion requests with ``engine``, recording them in their session."""

    def __init__(
        self,
        engine: HFService,
        tokenizer,
        limits: Limits,
        *,
        model_name: str = "unipg",
        any_model_name: bool = False,
        describe_tools: bool = True,
        tool_parser: str | None = None,
    ):
        """``model_name``: the model's name in requests and replies; ``any_model_name``: accept requests for any
        model name (else another name is a 404, as OpenAI answers a model it does not have); ``describe_tools``:
        render the request's ``tools`` into the prompt (else they only enable parsing); ``tool_parser``: the run's
        tool-call format (None: the one of the tokenizer's chat template)."""
        self.engine, self.tokenizer, self.limits = engine, tokenizer, limits
        self.model_name, self.any_model_name, self.describe_tools = model_name, any_model_name, describe_tools
        self.calls_format = tool_call_format(tokenizer) if tool_parser is None else ToolCallFormat(tool_parser)

    def params(self, request: _Request, *, tools: bool, json_schema: str | None = None) -> SamplingParams:
        """The engine's sampling parameters with the request's overrides; with tools, generation stops after a
        call's closing tag (one call per turn, as in the native agent loop); with ``json_schema``, the reply is
        decoded under its grammar."""
        base = self.engine.params
        stop = [request.stop] if isinstance(request.stop, str) else request.stop
        stop = list(base.stop or []) if stop is None else list(stop)
        keep: tuple[str, ...] = ()
        close = self.calls_format.close
        if tools and close is not None:  # a format whose call is the whole turn ends at the end-of-turn token
            keep = (close,)
            stop = stop if close in stop else [*stop, close]
        return replace(
            base,
            temperature=base.temperature if request.temperature is None else request.temperature,
            top_p=base.top_p if request.top_p is None else request.top_p,
            stop=stop or None,
            keep_stop=keep,
            json_schema=json_schema,
        )

    def serves(self, model: str | None) -> None:
        """Check the request's ``model``: the served name, any name with ``any_model_name``, or none (the served
        model); another is a 404 ``model_not_found``, as OpenAI answers."""
        if model is None or self.any_model_name or model == self.model_name:
            return
        raise RequestError(
            f"The model {model[:100]!r} does not exist: this endpoint serves {self.model_name!r} "
            "(endpoint.any_model_name: true accepts any name)",
            status=404,
            code="model_not_found",
        )

    def budget(self, request: _Request, context_ids: list[int], asked: int | None, prompt: str) -> int:
        """Tokens to generate per choice: ``asked`` (``max_tokens``; none: as many as fit), cut to this endpoint's
        limit (``Limits.max_tokens``). A prompt that fills the model's context, or ``asked`` tokens that would not
        fit after it, is a 400 naming ``prompt`` (the prompt's field), as OpenAI answers, rather than a reply
        shortened to fit."""
        if request.n > self.limits.max_n:
            raise RequestError(f"n ({request.n}) is more than this endpoint's limit of {self.limits.max_n}", "n")
        budget = min(asked or self.limits.max_tokens, self.limits.max_tokens)
        length, context = len(context_ids), self.limits.context_length
        if context is not None:
            if length >= context or (asked is not None and length + asked > context):
                wanted = f"{length} tokens in the prompt, which leaves no room for a completion"
                if asked is not None:
                    wanted = f"{length + asked} tokens ({length} in the prompt, {asked} in the completion)"
                raise RequestError(
                    f"This model's maximum context length is {context} tokens. However, you requested {wanted}. "
                    "Please reduce the length of the prompt or of max_tokens.",
                    prompt,
                    code="context_length_exceeded",
                )
            budget = min(budget, context - length)
        return budget

    async def sample(
        self, context: Context, request: _Request, params: SamplingParams, budget: int, session: Session | None
    ) -> list[TurnOutput]:
        order = session.order if session is not None else 0
        choices = [params] * request.n
        if request.seed is not None:
            choices = [replace(params, seed=seed) for seed in choice_seeds(request.seed, request.n)]
        outputs = await asyncio.gather(
            *(self.engine.generate(context.ids, max_new_tokens=budget, order=order, params=own) for own in choices)
        )
        if session is not None:
            session.record(context, list(outputs))
        return list(outputs)

    async def chat(self, request: ChatRequest, session: Session | None) -> dict:
        offered = check_tools(request.tools)
        tools = offered if request.tool_choice != "none" else None
        forced = forced_call(request.tool_choice, offered, self.calls_format)
        schema = response_schema(request.response_format)
        if schema is not None and forced is not None:
            raise RequestError(
                "response_format json_object or json_schema cannot be combined with a tool_choice that forces a "
                "call (the call's opening is no JSON document); use tool_choice 'auto' or 'none'",
                "response_format",
            )
        self.serves(request.model)
        context = self.chat_context(request, session, tools)
        opening = forced.opening if forced is not None else ""
        if opening:
            context = context.opened(tokenize(self.tokenizer, opening), opening)
        budget = self.budget(request, context.ids, request.max_completion_tokens or request.max_tokens, "messages")
        params = self.params(request, tools=bool(tools), json_schema=schema)
        outputs = await self.sample(context, request, params, budget, session)
        choices = [
            self.chat_choice(index, output, request, session, forced=forced, tools=bool(tools))
            for index, output in enumerate(outputs)
        ]
        return self.response("chat.completion", choices, context, outputs)

    def chat_context(self, request: ChatRequest, session: Session | None, tools: list[dict] | None) -> Context:
        """Where the reply starts: the rendered conversation, continuing a trajectory of ``session`` if it can."""
        raw = session.raw_replies if session is not None else {}
        messages = plain_messages(request.messages, raw, self.calls_format)
        text = render_conversation(self.tokenizer, messages, tools if self.describe_tools else None)
        if session is not None:
            return session.context(text, messages=request.messages)
        return Context(tokenize(self.tokenizer, text), text, None, [], 0)

    def chat_choice(
        self,
        index: int,
        output: TurnOutput,
        request: ChatRequest,
        session: Session | None,
        *,
        forced: ForcedCall | None,
        tools: bool,
    ) -> dict:
        """One choice of a chat reply: its message (tool calls parsed from a forced call's opening and what the
        policy sampled after it), log-probs of the sampled tokens and finish reason. As OpenAI answers, a call
        the named ``tool_choice`` forced finishes with "stop", any other call with "tool_calls"; a reply whose
        text is no call is its content, with the sampling's finish reason."""
        opening = forced.opening if forced is not None else ""
        content, calls = self.calls_format.parse(opening + output.text) if tools else (output.text, [])
        if session is not None:
            session.remember_reply(reply_key(content, calls), output.token_ids, opening)
        message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = openai_tool_calls(calls)
        finish = output.finish_reason
        if calls:
            finish = "stop" if forced is not None and forced.name is not None else "tool_calls"
        return {
            "index": index,
            "message": message,
            "logprobs": {"content": self.token_logprobs(output)} if request.logprobs else None,
            "finish_reason": finish,
        }

    async def complete(self, request: CompletionRequest, session: Session | None) -> dict:
        self.serves(request.model)
        ids = request.prompt if isinstance(request.prompt, list) else None
        if ids is not None and not all(0 <= token < len(self.tokenizer) for token in ids):
            raise RequestError("prompt holds token ids outside the vocabulary", "prompt")
        text = request.prompt if ids is None else ""
        if session is not None:
            context = session.context(text, ids)
        else:
            context = Context(ids if ids is not None else tokenize(self.tokenizer, text), text, None, [], 0)
        budget = self.budget(request, context.ids, request.max_tokens, "prompt")
        outputs = await self.sample(context, request, self.params(request, tools=False), budget, session)
        choices = [
            {
                "index": index,
                "text": output.text,
                "finish_reason": output.finish_reason,
                "logprobs": self.text_logprobs(output) if request.logprobs is not None else None,
            }
            for index, output in enumerate(outputs)
        ]
        return self.response("text_completion", choices, context, outputs)

    def response(self, kind: str, choices: list[dict], context: Context, outputs: list[TurnOutput]) -> dict:
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        generated = sum(len(output.token_ids) for output in outputs)
        return {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": len(context.ids),
                "completion_tokens": generated,
                "total_tokens": len(context.ids) + generated,
            },
        }

    def token_logprobs(self, output: TurnOutput) -> list[dict]:
        entries = []
        for token, logprob in zip(output.token_ids, output.behaviour_logprobs):
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            entries.append({"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []})
        return entries

    def text_logprobs(self, output: TurnOutput) -> dict:
        tokens = [self.tokenizer.decode([token], skip_special_tokens=False) for token in output.token_ids]
        offsets, position = [], 0
        for token in tokens:
            offsets.append(position)
            position += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": list(output.behaviour_logprobs),
            "top_logprobs": None,
            "text_offset": offsets,
        }


def choice_seeds(seed: int, n: int) -> list[int]:
    """The engine's seeds of a request's ``n`` choices: drawn from the request's ``seed``, so its choices differ
    from each other and are the same for every request with that seed."""
    draw = random.Random(seed)
    return [draw.getrandbits(62) for _ in range(n)]


def stream_chunks(response: dict, *, include_usage: bool = False):
    """A chat completion as the server-sent events of a stream: per choice, its content, its tool calls and its
    finish reason, then the usage if asked for, then ``[DONE]``. Generation is not incremental: the reply is
    complete before the first chunk, which clients that ask for a stream accept all the same."""
    head = {
        "id": response["id"],
        "object": "chat.completion.chunk",
        "created": response["created"],
        "model": response["model"],
    }
    for choice in response["choices"]:
        message, index = choice["message"], choice["index"]
        first = {"role": "assistant", "content": message["content"] or ""}
        yield {
            **head,
            "choices": [{"index": index, "delta": first, "logprobs": choice["logprobs"], "finish_reason": None}],
        }
        if message.get("tool_calls"):
            calls = [{"index": position, **call} for position, call in enumerate(message["tool_calls"])]
            yield {**head, "choices": [{"index": index, "delta": {"tool_calls": calls}, "finish_reason": None}]}
        yield {**head, "choices": [{"index": index, "delta": {}, "finish_reason": choice["finish_reason"]}]}
    if include_usage:
        yield {**head, "choices": [], "usage": response["usage"]}
