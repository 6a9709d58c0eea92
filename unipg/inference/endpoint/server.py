"""The OpenAI-compatible HTTP endpoint of the inference service (FastAPI, served by uvicorn).

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /v1/models/<model>``.
The bearer key says whose call it is: an episode's session key makes it a call of that episode (recorded), the
run's token an unrecorded call; every episode's agent thus calls the one base URL ``<server>/v1`` and only its key
differs. The same routes under ``/sessions/<id>/v1`` take only that session's own key (a session's key opens no
other session). A key that is neither is a 401 saying whether it belonged to an episode that has ended. Another
path is a 404, another method a 405, each an OpenAI error object as OpenAI answers them. The server runs as a task on the event loop of the
episodes, so its generation requests go to the same ``HFService`` and batch with everything else.

It binds 127.0.0.1 on a free port unless told otherwise; an address other machines can reach needs
``allow_remote`` (``endpoint.allow_remote``), and the server then says on stderr what it exposes. Bodies larger than
``max_body_bytes`` are refused (413) before they are parsed. A request's bad body or history is a 4xx error object
naming the field; a failure of the server itself is a 500 error object for that request alone (logged), never a
closed connection.
"""

import asyncio
import contextlib
import logging
import secrets
import socket
import sys

from unipg.config.lm import is_loopback
from unipg.inference.endpoint.protocol import ChatRequest, CompletionRequest, Completions, stream_chunks
from unipg.inference.endpoint.render import RequestError
from unipg.inference.endpoint.sessions import Sessions

logger = logging.getLogger(__name__)


def _error(
    status: int, message: str, param: str | None = None, kind: str = "invalid_request_error", code: str | None = None
):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


async def _unrouted(request, error):
    """The answer to a path no route serves (404) or a method its route does not take (405), as OpenAI's."""
    method_path = f"({request.method} {request.url.path})"
    if error.status_code == 405:
        response = _error(405, f"Invalid method for URL {method_path}")
        response.headers.update(error.headers or {})  # Allow: the route's methods
        return response
    if error.status_code == 404:
        return _error(404, f"Invalid URL {method_path}")
    return _error(error.status_code, str(error.detail))


class BodyLimit:
    """ASGI middleware: a request whose body passes ``limit`` bytes is answered 413 and never parsed;
    ``on_activity`` (if any) is called as each request begins and ends."""

    def __init__(self, app, limit: int, on_activity=None):
        self.app, self.limit, self.on_activity = app, limit, on_activity or (lambda: None)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        self.on_activity()
        try:
            return await self._limited(scope, receive, send)
        finally:
            self.on_activity()

    async def _limited(self, scope, receive, send):
        messages, size = [], 0
        while True:
            message = await receive()
            messages.append(message)
            size += len(message.get("body", b""))
            if size > self.limit:
                response = _error(413, f"the request body passes this endpoint's limit of {self.limit} bytes")
                return await response(scope, receive, send)
            if message["type"] != "http.request" or not message.get("more_body"):
                break

        async def replay():
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


def _refused(message: str):
    return _error(401, message, kind="authentication_error", code="invalid_api_key")


def _bearer(authorization: str | None) -> str | None:
    if authorization and authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


def caller(sessions: Sessions, token: str, session_id: str | None, headers):
    """Whose call a request is, from its bearer key: (its session, or None for the run's token; a 401 response,
    or None). ``session_id``: the session a ``/sessions/<id>/v1`` URL names (None: ``/v1``)."""
    key = _bearer(headers.get("authorization"))
    if key is None:
        return None, _refused("no API key was sent: send an episode's key as 'Authorization: Bearer <key>'")
    if session_id is None and secrets.compare_digest(key.encode(), token.encode()):
        return None, None
    session = sessions.by_key(key)
    if session is not None and session_id in (None, session.id):
        return session, None
    if session is not None:
        return None, _refused("this API key belongs to another session than the one in the URL")
    if sessions.ended(key):
        return None, _refused(
            "this API key belongs to an episode that has ended; use the api_key unipg passed to run for the "
            "current episode"
        )
    return None, _refused(
        "unknown API key: it is no open episode's key (an episode's key stops working when its episode ends); "
        "use the api_key unipg passed to run for this episode"
    )


def build_app(completions: Completions, sessions: Sessions, token: str, *, max_body_bytes: int):
    """The application: routes, authentication, and OpenAI-shaped errors.

    Routes are plain request handlers: the body is validated by its pydantic model straight from the bytes and
    the answer is a ``JSONResponse`` of plain data, which skips FastAPI's dependency resolution and response
    encoding (a third of the server's time per request)."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse
    from pydantic import ValidationError
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

    async def answer(request, method, model):
        session, refused = caller(sessions, token, request.path_params.get("session_id"), request.headers)
        if refused is not None:
            return refused
        try:
            body = request if model is None else model.model_validate_json(await request.body())
            response = await method(body, session)
        except ValidationError as error:
            return _invalid(error)
        except RequestError as error:
            return _error(error.status, str(error), error.param, code=error.code)
        except Exception:  # noqa: BLE001 — a failure of the server or the engine: this request fails, not the connection
            logger.exception("the endpoint failed to answer %s", request.url.path)
            return _error(500, "the server failed to answer this request; its log has the error", kind="server_error")
        if model is not None and getattr(body, "stream", None):
            return _event_stream(response, include_usage=bool((body.stream_options or {}).get("include_usage")))
        return JSONResponse(response)

    async def models(request, session):
        return {"object": "list", "data": [_model_object(completions.model_name)]}

    async def model(request, session):
        name = request.path_params["model"]
        completions.serves(name)
        return _model_object(name)

    for prefix in ("/v1", "/sessions/{session_id}/v1"):
        for path, method, body, verb in (
            ("chat/completions", completions.chat, ChatRequest, "POST"),
            ("completions", completions.complete, CompletionRequest, "POST"),
            ("models", models, None, "GET"),
            ("models/{model:path}", model, None, "GET"),  # a model's name may hold slashes (org/name)
        ):
            app.add_route(f"{prefix}/{path}", _route(answer, method, body), methods=[verb])
    app.add_exception_handler(StarletteHTTPException, _unrouted)
    # the engine's batching waits for more requests while the endpoint is busy (``HFService.note_activity``)
    return BodyLimit(app, max_body_bytes, getattr(completions.engine, "note_activity", None))


def _model_object(name: str) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "unipg"}


def _route(answer, method, body):
    """A route handler: ``method(request body, session)``; a route without a body model (``body`` None) is handed
    the request itself."""

    async def route(request):
        return await answer(request, method, body)

    return route


def _invalid(error):
    """The 400 answer to a body its model refused, naming the first offending field."""
    first = error.errors()[0]
    field = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    field = field or "body"
    if first["type"] == "extra_forbidden":
        return _error(400, f"unsupported field '{field}'", field)
    return _error(400, f"{field}: {first['msg'].removeprefix('Value error, ')}", field)


def _event_stream(response: dict, *, include_usage: bool):
    import json

    from fastapi.responses import StreamingResponse

    async def events():
        for chunk in stream_chunks(response, include_usage=include_usage):
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


class EndpointServer:
    """The endpoint on the running event loop: ``async with server.serving(): ...``; ``base_url`` and
    ``token`` are set while it serves. ``port`` 0 binds a free port; after that ``port`` is the one bound."""

    def __init__(
        self,
        completions: Completions,
        sessions: Sessions,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        max_body_bytes: int = 1 << 20,
        allow_remote: bool = False,
    ):
        """``allow_remote``: bind ``host`` even if it is not a loopback address (other machines can then call)."""
        if not allow_remote and not is_loopback(host):
            raise ValueError(f"host {host!r} is not a loopback address; pass allow_remote=True to serve other machines")
        self.completions, self.sessions = completions, sessions
        self.host, self.port, self.max_body_bytes = host, port, max_body_bytes
        self.token = secrets.token_urlsafe(24)
        self.base_url: str | None = None
        self.http = None  # the uvicorn server while it serves

    @property
    def url(self) -> str:
        """The base URL of every episode's calls (``<server>/v1``): the key of a call says whose it is."""
        return f"{self.base_url}/v1"

    def session_url(self, session_id: str) -> str:
        """The base URL that takes one session's key only."""
        return f"{self.base_url}/sessions/{session_id}/v1"

    @contextlib.asynccontextmanager
    async def serving(self):
        import uvicorn

        app = build_app(self.completions, self.sessions, self.token, max_body_bytes=self.max_body_bytes)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto given explicitly: asyncio turns Nagle's algorithm off only on sockets whose proto is TCP, and a
        # response written as headers then body would otherwise wait out the client's delayed ACK (~40 ms)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError:
            sock.close()
            raise
        port = self.port = sock.getsockname()[1]
        started = asyncio.Event()
        server = _Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False), started)
        task = asyncio.create_task(server.serve(sockets=[sock]))
        try:
            waiter = asyncio.create_task(started.wait())
            await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
            if not started.is_set():
                waiter.cancel()
                task.result()  # the server's own error
                raise RuntimeError("the endpoint stopped before it started")
            host = f"[{self.host}]" if family == socket.AF_INET6 else self.host
            self.base_url, self.http = f"http://{host}:{port}", server
            if not is_loopback(self.host):
                print(f"notice: {exposure(self.base_url)}", file=sys.stderr, flush=True)
            yield self
        finally:
            server.should_exit = True
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await task
            sock.close()
            self.base_url = self.http = None


def exposure(base_url: str) -> str:
    """What an endpoint bound beyond loopback exposes, and how it is protected."""
    return (
        f"the endpoint at {base_url} accepts connections from other machines (endpoint.allow_remote): "
        "/v1/chat/completions, /v1/completions and /v1/models, each also under /sessions/<id>/v1. Every request "
        "needs a bearer key: an open episode's session key or the run's token for /v1, a session's own key for its "
        "URL, all random per run and session (there is no API key setting, so none is set or reused). Traffic is "
        "plain HTTP, not encrypted: "
        "anyone on the network path can read the keys and the conversations; serve it on a private network or "
        "behind a TLS proxy"
    )


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server that says when it is listening and leaves signals to the process it runs in."""

        def __init__(self, config, started: asyncio.Event):
            super().__init__(config)
            self.started_event = started

        async def startup(self, sockets=None):
            await super().startup(sockets=sockets)
            self.started_event.set()

        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return Server


def _Server(config, started):  # noqa: N802 — a class built on first use: uvicorn is imported lazily
    return _server_class()(config, started)
