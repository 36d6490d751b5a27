"""The dashboard at ``/ui``: server-rendered pages (Jinja2) with a little JavaScript, served by the API.

``create_ui()`` is a FastAPI application that ``api.main`` mounts at ``/ui``, so the API's key
dependency does not apply to it: a page needs a dashboard session (``shared.store.ui_sessions``)
and sends the browser to ``/ui/login`` without one. The pages read through the same ``shared``
helpers as the API, with the session's ``Caller``; the scripts on the pages call the API itself
(streams, uploads, creating and cancelling jobs) with the session cookie and its CSRF token
(``api.auth``). Nothing is loaded from another host: uPlot is vendored in ``static/vendor`` (see
its ``VERSIONS``), and the pages' Content-Security-Policy allows this origin only.
"""

from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles
from obstore.exceptions import BaseError as ObjectStoreError
from sqlalchemy.exc import OperationalError
from sqlalchemy.exc import TimeoutError as PoolTimeout

from api.errors import service_failure
from api.feeds import Feeds
from api.ui import pages
from shared.errors import UserError

STATIC_DIR = Path(__file__).parent / "static"
# Scripts, styles, images and connections from this origin only; uPlot sets element styles from script.
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
)


def create_ui(feeds: Feeds) -> FastAPI:
    """The dashboard application, to be mounted at ``/ui``, reading live jobs through ``feeds``
    (the API's: one store reader for the API and its dashboard)."""
    ui = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
    ui.state.feeds = feeds
    ui.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    ui.include_router(pages.router)

    @ui.exception_handler(pages.SignInRequired)
    async def _sign_in(request: Request, _: pages.SignInRequired):
        return RedirectResponse(pages.login_url(request), status_code=303)

    @ui.exception_handler(UserError)
    async def _user_error(request: Request, e: UserError):
        return pages.error_page(request, e.status, e.message)

    @ui.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        return pages.error_page(request, 400, f"{'.'.join(map(str, first['loc'][1:]))}: {first['msg']}")

    @ui.exception_handler(OperationalError)
    @ui.exception_handler(PoolTimeout)
    @ui.exception_handler(ObjectStoreError)
    @ui.exception_handler(OSError)
    async def _service_failed(request: Request, e: Exception):
        # a full disk, the job store or the bucket down: the API's status, words and headers, as a page
        if (failure := service_failure(request, e)) is None:
            raise e  # a 500
        page = pages.error_page(request, failure.status, failure.message)
        page.headers.update(failure.headers or {})
        return page

    @ui.exception_handler(404)
    async def _not_found(request: Request, _: Exception):
        return pages.error_page(request, 404, f"there is no page at {request.url.path}")

    @ui.middleware("http")
    async def _headers(request: Request, call_next):
        response = await call_next(request)
        response.headers.setdefault("Content-Security-Policy", CSP)
        response.headers.setdefault("X-Content-Type-Options", "nosniff")
        response.headers.setdefault("Referrer-Policy", "same-origin")
        if response.headers.get("content-type", "").startswith("text/html"):
            response.headers.setdefault("Cache-Control", "no-store")  # pages hold tenant data and the CSRF token
        return response

    return ui
