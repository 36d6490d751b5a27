"""Which Host and Origin headers the API answers.

- **Host** (against DNS rebinding: a web page whose name an attacker re-points at 127.0.0.1 would
  otherwise reach a loopback-bound server as if it were that site): the bound host, the localhost
  forms and ``TUNEJOB_ALLOWED_HOSTS``; anything else gets 400 ``invalid_host``. Matching is
  Starlette's ``TrustedHostMiddleware`` (``*.example.com`` patterns; ``*`` turns the check off).
- **Origin** (against cross-site requests from a browser): a state-changing request (not GET, HEAD
  or OPTIONS) that carries an ``Origin`` header whose host is not an allowed host gets 403
  ``cross_origin_request``. API keys travel in a header that browsers never add by themselves and
  the API sends no CORS headers, so a foreign page cannot use a key it does not have; this check is
  a second line, for a page that somehow holds one. Clients that are not browsers send no Origin.
"""

from urllib.parse import urlsplit

from starlette._utils import parse_host_header
from starlette.datastructures import Headers
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from api.errors import error_response, openai_type
from shared.settings import get_settings

LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")
WILDCARD_ADDRESSES = ("", "0.0.0.0", "::", "[::]")
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def allowed_hosts(bound_host: str) -> list[str]:
    """Host names the API answers when listening on ``bound_host``."""
    bound = [] if bound_host in WILDCARD_ADDRESSES else [f"[{bound_host}]" if ":" in bound_host else bound_host]
    return list(dict.fromkeys([*LOCAL_HOSTS, *bound, *get_settings().allowed_hosts]))


class HostAndOriginCheck(TrustedHostMiddleware):
    """Starlette's Host check, answering in the API's error format, plus the Origin check above."""

    def __init__(self, app: ASGIApp, allowed_hosts: list[str]):
        super().__init__(app, allowed_hosts, www_redirect=False)

    def allows(self, host: str | None) -> bool:
        """Whether ``host`` (as in a Host header, without the port) is one of the allowed hosts."""
        if host is None:
            return False
        host = host.lower()
        return any(host == p or (p.startswith("*") and host.endswith(p[1:])) for p in self.allowed_hosts)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.allow_any or scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        host, origin = headers.get("host"), headers.get("origin")
        if not self.allows(getattr(parse_host_header(host), "host", None)):
            response = error_response(
                400,
                "invalid_host",
                f"Host {host!r} is not served here; the allowed hosts are "
                f"{self.allowed_hosts} (add names with TUNEJOB_ALLOWED_HOSTS)",
                "Host",
                error_type=openai_type(scope.get("path", "")),
            )
        elif (
            origin is not None
            and scope.get("method", "GET") not in SAFE_METHODS
            and not self.allows(getattr(parse_host_header(urlsplit(origin).netloc), "host", None))
        ):
            response = error_response(
                403,
                "cross_origin_request",
                f"requests from the web page at {origin!r} are "
                "refused (cross-site); call the API from a script, or from an allowed host",
                "Origin",
                error_type=openai_type(scope.get("path", "")),
            )
        else:
            await self.app(scope, receive, send)
            return
        await response(scope, receive, send)
