"""`h3direct serve`: the models loaded once, generations over HTTP/1.1 (FastAPI + uvicorn; OpenAPI at /openapi.json,
interactive docs at /docs), by concern:

- `schema.py`   the request body, made from `GenerateRequest`'s fields and the per-request options;
- `service.py`  the server's settings, the resident models, requests checked at the door, the jobs, /ready;
- `http.py`     the routes, one-line JSON errors, the body limit, the bearer token;
- `server.py`   the socket, uvicorn, loading in a thread, signals.

Its flags: `app/cli_serve.py`. Beyond this machine (`--host` not a loopback address) it needs `--auth-token-file F`
(every route but /health then needs `Authorization: Bearer <token>`), unless `--insecure` is given.
"""

from h3direct.app.serve.server import HTTPServer, bind, run
from h3direct.app.serve.service import DEFAULT_PORT, ServerSettings, Service

__all__ = ["DEFAULT_PORT", "HTTPServer", "ServerSettings", "Service", "bind", "run"]
