"""The HTTP layer of `h3direct serve` (FastAPI): the routes, their one-line JSON errors, the body limit and the
bearer-token check. Everything behind a route is the `Service` (`service.py`).

    GET    /health             liveness: 200 {"status": "loading" | "ready" | "stopping"} (never needs the token)
    GET    /ready              200 when the models are loaded: components (dtype, quantization, device), memory
                               in use and the weights held (`app/footprint.py`), the text encoder's residency
                               (policy, where it is, its last move: `app/residency.py`), the attention values a
                               request may use, the options a request may set (and those fixed at load), limits,
                               queue, version; 503 while loading or stopping
    POST   /generate           a request (JSON, the fields of `GenerateRequest` and the per-request options):
                               waits, answers the summary `h3direct generate` prints (with provenance); a client that
                               leaves drops its job
    POST   /jobs               the same request; answers 202 {"id", ...} at once
    GET    /jobs               the most recent jobs (?limit=100), newest first
    GET    /jobs/{id}          state (queued | running | done | failed | cancelled), stage, step, progress,
                               timings, summary or error
    DELETE /jobs/{id}          cancel: a queued job at once, a running one at its next stage or sampler step
    GET    /jobs/{id}/output   the mp4 (video/mp4) of a finished job
    GET    /jobs/{id}/events   progress as server-sent events (`event: progress` ... then `event: done|failed|
                               cancelled`), each `data:` the job as GET /jobs/{id} shows it
    GET    /docs               Swagger UI, its files served from the fastapi-swagger package under /docs/assets/ (no
                               CDN: it works offline); like every route but /health it needs the token, when there is
                               one. ReDoc (CDN-only in FastAPI) is off

Statuses: 422 a field of the wrong type, an unknown field, a value outside its choices, non-UTF-8 text (the error
names the field); 400 a value out of range or beyond a limit, an input file that is not under --input-root or does
not exist (one answer for both), a reference that is not a readable image/video/audio, an `output` that is not a
relative `.mp4` path inside --output-root; 409 an `output` or `save_latent` file that exists (unless the request sets
`overwrite`) or that a queued or running job will write; 401 a missing or wrong bearer token (when the server has
one); 413 a body over --max-body-mb; 429 + Retry-After the queue is full; 503 + Retry-After loading or stopping. A
job that fails once running answers its error: 400 (its input turned out bad), 504 (over --job-timeout), 409
(cancelled), 503 (shutdown), 507 (out of memory), 500 (a bug; traceback on the server's stderr only). Errors are
{"error": "<one line>"}.
"""

# no `from __future__ import annotations`: FastAPI reads the endpoints' annotations, some of them local classes
import asyncio
import functools
import hmac
import json
import sys

from h3direct.app.jobs import FINAL, Full, Job, Stopping, one_line
from h3direct.app.serve.schema import request_model, validation_message
from h3direct.app.serve.service import NotReady, Service
from h3direct.errors import H3Error, RequestError

POLL_S = 0.02  # how often a waiting /generate looks at its job and its client
OPEN_PATHS = ("/health",)  # the routes that never need the token
DOCS_ASSETS_URL = "/docs/assets"
# the Swagger UI files /docs loads: name in the fastapi-swagger package -> content type
DOCS_ASSETS = {"swagger-ui-bundle.js": "text/javascript", "swagger-ui.css": "text/css",
               "favicon-32x32.png": "image/png"}
DOCS_PACKAGE = "fastapi_swagger.resources"
STATUS_OF_KIND = {"type": 422, "choice": 422, "conflict": 409}  # a RequestError's kind -> HTTP status (else 400)


def _error(status: int, message: str, headers: dict | None = None):
    from fastapi.responses import JSONResponse

    return JSONResponse({"error": one_line(message)}, status_code=status, headers=headers)


class _BodyLimit:
    """ASGI middleware: a request body over `limit` bytes is answered 413 (declared or streamed)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        too_big = f"the body is over the limit of {self.limit} bytes"
        if declared is not None and (not declared.strip().isdigit() or int(declared) > self.limit):
            resp = _error(413 if declared.strip().isdigit() else 400,
                          too_big if declared.strip().isdigit() else "Content-Length is not a byte count")
            return await resp(scope, receive, send)
        seen = 0
        over = False

        async def counted():
            # past the limit the body is cut short (the app sees an end), and `answer` swaps its reply for a 413
            nonlocal seen, over
            if over:
                return {"type": "http.request", "body": b"", "more_body": False}
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > self.limit:
                    over = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return msg

        async def answer(msg):
            if not over:
                return await send(msg)
            if msg["type"] == "http.response.start":
                await _error(413, too_big)(scope, receive, send)

        await self.app(scope, counted, answer)


class _BearerToken:
    """ASGI middleware: with a token, every route but /health needs `Authorization: Bearer <token>` (compared in
    constant time); 401 otherwise."""

    def __init__(self, app, token: str | None):
        self.app, self.token = app, token

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.token is None or scope.get("path") in OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers") or []).get(b"authorization", b"")
        want = b"Bearer " + self.token.encode()
        if not hmac.compare_digest(given, want):
            what = "a wrong bearer token" if given else "no Authorization header"
            resp = _error(401, f"{what}: this server needs Authorization: Bearer <token>",
                          {"WWW-Authenticate": 'Bearer realm="h3direct"'})
            return await resp(scope, receive, send)
        return await self.app(scope, receive, send)


def create_app(service: Service):
    """(the ASGI app with its middleware, the FastAPI app)."""
    from fastapi import FastAPI

    from h3direct.app.provenance import version

    app = FastAPI(title="h3direct", version=version(), description=__doc__.split("\n\n")[0], docs_url=None,
                  redoc_url=None)
    _error_handlers(app)
    _generation_routes(app, service)
    _job_routes(app, service)
    _docs_routes(app)
    return _BearerToken(_BodyLimit(app, service.max_body_bytes), service.token), app


def _error_handlers(app) -> None:
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):
        status, msg = validation_message(exc.errors())
        return _error(status, msg)

    @app.exception_handler(HTTPException)
    async def _http(request, exc):
        from http import HTTPStatus

        msg = str(exc.detail)
        if msg == HTTPStatus(exc.status_code).phrase:  # starlette's own: say what to do
            msg = {404: f"no such endpoint {request.url.path!r}; see /docs",
                   405: f"{request.method} {request.url.path}: method not allowed"}.get(exc.status_code, msg)
        elif "parsing the body" in msg:
            msg = "cannot parse the body as JSON (UTF-8, nested at most ~1000 deep, integers under 4300 digits)"
        return _error(exc.status_code, msg, getattr(exc, "headers", None))

    @app.exception_handler(UnicodeDecodeError)
    async def _not_utf8(request, exc):
        return _error(400, "the body is not UTF-8 JSON")

    @app.exception_handler(Exception)
    async def _bug(request, exc):
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}")


async def _admitted(service: Service, req):
    """(job, None) or (None, the error response)."""
    from starlette.concurrency import run_in_threadpool

    try:
        return await run_in_threadpool(service.admit, req.model_dump(exclude_unset=True)), None
    except RequestError as e:
        return None, _error(STATUS_OF_KIND.get(e.kind, 400), str(e))
    except H3Error as e:
        return None, _error(400, str(e))
    except Full as e:
        return None, _error(429, f"the queue is full ({service.queue.size} waiting); retry later",
                            {"Retry-After": str(e.retry_after)})
    except (Stopping, NotReady) as e:
        status = "stopping" if isinstance(e, Stopping) else e.status
        return None, _error(503, f"the server is {status}", {"Retry-After": "5"})


def _generation_routes(app, service: Service) -> None:
    from fastapi import Request
    from fastapi.responses import JSONResponse

    GenerateRequest = request_model()

    @app.get("/health", summary="liveness")
    def health():
        return {"status": service.state}

    @app.get("/ready", summary="readiness: resident models, memory, attention values, options, limits, queue")
    def ready():
        if service.state != "ready":
            body = {"status": service.state}
            if service.error:
                body["error"] = service.error
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        return service.ready()

    @app.post("/generate", summary="generate and wait: the summary of `h3direct generate`")
    async def generate(req: GenerateRequest, request: Request):
        job, err = await _admitted(service, req)
        if err is not None:
            return err
        while not job.done.is_set():
            if await request.is_disconnected():
                service.queue.cancel(job, "the client disconnected")
                return _error(499, "client disconnected")
            await asyncio.sleep(POLL_S)
        if job.state == "done":
            return job.summary
        return _error(job.status, job.error or job.state)

    @app.post("/jobs", status_code=202, summary="queue a generation; answers its id at once")
    async def submit(req: GenerateRequest):
        job, err = await _admitted(service, req)
        if err is not None:
            return err
        return JSONResponse({**job.view(), "links": _links(job)}, status_code=202,
                            headers={"Location": f"/jobs/{job.id}"})


def _job_routes(app, service: Service) -> None:
    from fastapi import Request
    from fastapi.responses import FileResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException

    @app.get("/jobs", summary="the most recent jobs (newest first), as GET /jobs/{id} shows each")
    def job_list(limit: int = 100):
        jobs = service.queue.recent(max(0, min(limit, 1000)))
        return {"jobs": [{**j.view(), "links": _links(j)} for j in jobs]}

    def find(job_id: str) -> Job:
        job = service.queue.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id!r}")
        return job

    @app.get("/jobs/{job_id}", summary="a job's state, stage, step, progress, timings, summary or error")
    def job_status(job_id: str):
        job = find(job_id)
        return {**job.view(), "links": _links(job)}

    @app.delete("/jobs/{job_id}", summary="cancel a job (a running one stops at its next step)")
    def job_cancel(job_id: str):
        job = find(job_id)
        service.queue.cancel(job, "cancelled by the client")
        return {**job.view(), "cancel_requested": job.state not in FINAL}

    @app.get("/jobs/{job_id}/output", summary="the finished job's mp4", response_class=FileResponse)
    def job_output(job_id: str):
        job = find(job_id)
        if job.state != "done":
            return _error(409, f"job {job_id} is {job.state}; its output exists once it is done")
        if not job.output.is_file():
            return _error(410, f"the output of job {job_id} is gone from the output folder")
        return FileResponse(job.output, media_type="video/mp4", filename=job.output.name)

    @app.get("/jobs/{job_id}/events", summary="progress as server-sent events")
    async def job_events(job_id: str, request: Request):
        job = find(job_id)

        async def stream():
            seen = -1
            while True:
                version_now = job.version
                if version_now != seen:
                    seen = version_now
                    view = job.view()
                    kind = job.state if job.state in FINAL else "progress"
                    yield f"event: {kind}\ndata: {json.dumps(view, separators=(',', ':'))}\n\n"
                    if kind != "progress":
                        return
                if await request.is_disconnected():
                    return
                await run_in_threadpool(service.queue.wait_changed, job, seen, 0.5)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def _docs_routes(app) -> None:
    """/docs: FastAPI's Swagger UI page, loading its files from this server (`DOCS_ASSETS`), not from a CDN."""
    from fastapi.openapi.docs import get_swagger_ui_html
    from fastapi.responses import Response
    from starlette.exceptions import HTTPException

    @app.get("/docs", include_in_schema=False)
    def docs():
        return get_swagger_ui_html(openapi_url=app.openapi_url, title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_ASSETS_URL}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_ASSETS_URL}/favicon-32x32.png",
                                   swagger_ui_parameters={"validatorUrl": None})  # (its default is an online one)

    @app.get(DOCS_ASSETS_URL + "/{name}", include_in_schema=False)
    def docs_asset(name: str):
        if name not in DOCS_ASSETS:
            raise HTTPException(404, f"no docs file {name!r}; /docs loads {', '.join(DOCS_ASSETS)}")
        try:
            return Response(_docs_file(name), media_type=DOCS_ASSETS[name])
        except ModuleNotFoundError:
            return _error(500, "the docs' Swagger UI files come with the serve extra (the fastapi-swagger package): "
                          "pip install 'h3direct[serve]'")


@functools.cache
def _docs_file(name: str) -> bytes:
    from importlib import resources

    return resources.files(DOCS_PACKAGE).joinpath(name).read_bytes()


def _links(job: Job) -> dict:
    base = f"/jobs/{job.id}"
    return {"self": base, "events": f"{base}/events", "output": f"{base}/output"}
