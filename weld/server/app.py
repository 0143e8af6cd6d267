"""The FastAPI app and `serve()`: routes, API-key check, error shapes, graceful shutdown.

    GET  /health /version /metrics /v1/models /tokenizer_info
    POST /v1/completions /v1/chat/completions /tokenize /detokenize
    GET  /  (the chat page: weld/server/static, plain files)

The engine is injected (`build_app(engine, config)`): anything with AsyncLLM's `generate`,
`abort`, `stats`, `first_step_start`, `tokenizer`, `is_running` and `shutdown` will do. So is
tracing (`build_app(..., tracing=Tracing(provider))`, `weld.server.tracing`): without it the
OpenTelemetry SDK is never imported. With an
API key, every route needs `Authorization: Bearer <key>` but /health and the chat page's files
(they hold no data): the page asks for the key and sends it on its own API calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import pathlib
import sys
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from weld import __version__
from weld.server.chat import create_chat_completion, normalize_messages
from weld.server.completions import create_completion
from weld.server.errors import APIError
from weld.server.protocol import DetokenizeRequest, TokenizeRequest, openapi_schema, parse_body
from weld.server.serving import ServerConfig, ServerState
from weld.utils.errors import InvalidInputError, WeldError
from weld.utils.memory import release_free_memory

logger = logging.getLogger("weld.server")
PAGE_DIR = pathlib.Path(__file__).parent / "static"
PAGE_FILES = {"/": "index.html", "/static/chat.js": "chat.js", "/static/chat.css": "chat.css"}
# the page may load its own files and call this server, nothing else
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data:; base-uri 'none'; "
                                           "form-action 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff"}
# what --api-key leaves open: a load balancer's probe, and the chat page's static files
OPEN_ROUTES = frozenset({"/health", *PAGE_FILES})
# OpenAI and vLLM routes weld does not serve (yet): their 404 says so (the README's "Not built yet")
NOT_BUILT = ("/v1/responses", "/v1/embeddings", "/v1/audio", "/v1/images", "/v1/moderations", "/v1/files",
             "/v1/batches", "/v1/fine_tuning", "/pooling", "/classify", "/score", "/v1/score", "/rerank", "/v1/rerank",
             "/v2/rerank")


def _page_file(name: str):
    path = PAGE_DIR / name

    async def page_file():
        return FileResponse(path, headers=PAGE_HEADERS)

    return page_file


async def _json_body(request: Request, limit: int) -> Any:
    """The decoded JSON body, read up to `limit` bytes: a larger one (by its Content-Length, or
    as it streams in) is a 413 before the rest is read."""
    too_large = APIError(413, f"the request body exceeds the server's limit of {limit} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from None
    except RecursionError:  # arrays or objects nested thousands deep
        raise APIError(400, "the request body nests too deeply") from None


def build_app(engine: Any, config: ServerConfig, tracing: Any = None) -> FastAPI:
    """The app; `tracing`: a `weld.server.tracing.Tracing` to trace completion and chat requests."""
    state = ServerState(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state.draining = True
        await asyncio.to_thread(engine.shutdown)
        if tracing is not None:
            await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(title="weld", version=__version__, lifespan=lifespan, docs_url="/docs", redoc_url=None)

    def openapi():  # the routes read their own bodies: describe them from their models
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            app.openapi_schema = openapi_schema(get_openapi(title=app.title, version=app.version, routes=app.routes))
        return app.openapi_schema

    app.openapi = openapi
    app.state.weld = state

    expected_auth = f"Bearer {config.api_key}".encode() if config.api_key else None

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        """With --api-key, every route but /health needs `Authorization: Bearer <key>`, compared
        in constant time (no timing hint of how much of a guess was right)."""
        if expected_auth is not None and request.url.path not in OPEN_ROUTES:
            given = request.headers.get("authorization", "").encode("utf-8", "replace")
            if not hmac.compare_digest(given, expected_auth):
                return APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                                code="invalid_api_key").response()
        return await call_next(request)

    # added last, so outermost: a browser's preflight (no Authorization) is answered before the key check
    if config.allowed_origins:  # closed by default: a page on another origin cannot call the API
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        return err.response()

    @app.exception_handler(WeldError)
    async def on_weld_error(request: Request, err: WeldError):
        status = 400 if isinstance(err, InvalidInputError) else 503 if not engine.is_running else 500
        return APIError(status, str(err)).response()

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException):
        path = request.url.path
        if err.status_code == 404 and any(path == p or path.startswith(p + "/") for p in NOT_BUILT):
            return APIError(404, f"weld does not serve {path} yet: it serves /v1/completions and "
                                 "/v1/chat/completions (the routes are listed at /docs)").response()
        return APIError(err.status_code, str(err.detail)).response()

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError):
        return APIError(400, str(err)).response()

    @app.exception_handler(Exception)
    async def on_bug(request: Request, err: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        return APIError(500, f"internal error: {type(err).__name__}: {err}").response()

    @app.get("/health", response_class=Response,
             responses={200: {"description": "serving (an empty body)", "content": {}}})
    async def health():
        if not engine.is_running or state.draining:
            return APIError(503, "the engine is not running" if not engine.is_running
                            else "the server is shutting down").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text", "content": {CONTENT_TYPE_LATEST: {}}}})
    async def metrics():
        state.metrics.update_from_stats(await asyncio.to_thread(engine.stats))
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = {"id": config.served_model_name, "object": "model", "created": state.created, "owned_by": "weld",
                "root": config.model_root or config.served_model_name, "parent": None,
                "max_model_len": config.max_model_len}
        return {"object": "list", "data": [card]}

    async def generation(request: Request, operation: str, handler: Any):
        """A completion or chat request, traced when tracing is on (the trace ends with the
        response, or with a streaming response's last chunk)."""
        if tracing is None:
            return await handler(state, await _json_body(request, config.max_body_bytes), request)
        trace = tracing.begin(operation, config.served_model_name, request.headers, request.url.path)
        try:
            response = await handler(state, await _json_body(request, config.max_body_bytes), request, trace)
        except BaseException as err:
            trace.end(500, err)
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = trace.until_end(response.body_iterator)
        else:
            trace.end(response.status_code)
        return response

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generation(request, "text_completion", create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generation(request, "chat", create_chat_completion)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        req: TokenizeRequest = parse_body(TokenizeRequest, await _json_body(request, config.max_body_bytes))
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            text = state.tokenizer.apply_chat_template(
                normalize_messages(req.messages), add_generation_prompt=req.add_generation_prompt, tools=tools,
                continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}))
            ids = state.tokenizer.encode(text, add_special_tokens=False)
        else:
            ids = state.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": config.max_model_len, "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            body["token_strs"] = [state.tokenizer.id_to_token(i) for i in ids]
        return body

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """The special tokens and chat template, as vLLM's /tokenizer_info: with /tokenize and
        /detokenize, what lm-eval's remote tokenizer backend uses instead of a local tokenizer."""
        tok = state.tokenizer
        return {"tokenizer_class": type(tok).__name__, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
                "pad_token": tok.pad_token, "chat_template": tok.chat_template,
                "model_max_length": config.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req: DetokenizeRequest = parse_body(DetokenizeRequest, await _json_body(request, config.max_body_bytes))
        state.check_model(req.model)
        return {"prompt": state.tokenizer.decode(req.tokens)}

    for path, name in PAGE_FILES.items():
        app.add_api_route(path, _page_file(name), methods=["GET"], include_in_schema=False)

    return app


def serve(engine: Any, config: ServerConfig, host: str = "127.0.0.1", port: int = 8000,
          log_level: str = "info", tracing: Any = None) -> int:
    """Runs the app under uvicorn until SIGINT/SIGTERM or the engine thread's death, and returns
    the exit status: 130 / 143 after SIGINT / SIGTERM (new requests get a 503, or find the socket
    closed, while those in flight finish; then the engine shuts down), 1 when the engine thread
    died (every open request has had its error, /health said 503; the server stops at once
    rather than hang or answer 503 forever), else 0."""
    import uvicorn

    app = build_app(engine, config, tracing)
    status = [0]

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            app.state.weld.draining = True
            status[0] = status[0] or 128 + int(sig)
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if not engine.is_running and not app.state.weld.draining:
                app.state.weld.draining = True
                status[0] = 1
                cause = getattr(engine, "error", None)
                print(f"weld: error: the engine thread died ({type(cause).__name__}: {cause}); stopping the server"
                      if cause is not None else "weld: error: the engine thread died; stopping the server",
                      file=sys.stderr, flush=True)
                self.should_exit = True
            return await super().on_tick(counter)

    server = _Server(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                    timeout_graceful_shutdown=None))
    server.run()
    return status[0]


def warmup(engine: Any, mode: str = "basic") -> None:
    """Compiles before the first request arrives: "basic" the batch-1 prefill and decode
    programs (one request through the async path), "full" every shape the scheduler can make
    (`LLM.warmup(full=True)`), "none" nothing. From here on the runner drops JAX's tracing
    caches after each run of compiles (a served process's memory: ~32 MB of the bundled model's)."""
    from weld.engine.sampling_params import SamplingParams

    engine.engine.runner.drop_traces = True
    if mode == "none":
        return
    if mode == "full":
        engine.warmup(full=True)

    async def run():
        async for _ in engine.generate({"prompt_token_ids": [0] * 8}, SamplingParams(max_tokens=2, temperature=0),
                                       request_id=f"warmup-{time.monotonic_ns()}"):
            pass

    asyncio.run(run())
    release_free_memory()  # what compiling freed
