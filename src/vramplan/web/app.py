"""The web page's server (Starlette, the `web` extra): `GET /` the page, `/static/` its
files, and the JSON API of web/api.py under `/api/<name>` (POST estimate, compare, fit,
import; GET models, gpus, choices). Handlers run on the event loop's thread one at a time,
so the process-wide language that web.api.answer sets is the request's for its whole answer.
"""
from __future__ import annotations

from importlib import resources

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from vramplan.web.api import ENDPOINTS, answer

STATIC = resources.files("vramplan.web") / "static"


def create_app() -> Starlette:
    """The application `vramplan serve` runs (also for tests: starlette.testclient)."""
    routes = [Route("/", _index)]
    for name, (_handler, spec_body) in ENDPOINTS.items():
        methods = ["POST"] if spec_body or name == "import" else ["GET"]
        routes.append(Route(f"/api/{name}", _endpoint(name), methods=methods))
    routes.append(Mount("/static", StaticFiles(directory=str(STATIC)), name="static"))
    return Starlette(routes=routes)


async def _index(request: Request):
    return FileResponse(str(STATIC / "index.html"), media_type="text/html")


def _endpoint(name: str):
    async def endpoint(request: Request):
        status, payload = answer(name, request.query_params, await request.body())
        return JSONResponse(payload, status_code=status)
    return endpoint
