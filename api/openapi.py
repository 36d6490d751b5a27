"""The app's OpenAPI schema: FastAPI's, with the error body of ``api.errors`` (``ErrorBody``)
documented for every 4xx an operation can return, and no security requirement on the public paths
(``api.auth.PUBLIC_PATHS``). Apart from ``api.errors``, so that the error handlers need nothing of
the authentication, which answers in their format."""

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from api.auth import PUBLIC_PATHS
from api.errors import ERROR_STATUSES, ErrorBody


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` (``/openapi.json``, the docs site's reference) build the schema below, once."""
    app.openapi = lambda: _schema(app)  # type: ignore[method-assign]


def _schema(app: FastAPI) -> dict:
    """FastAPI's schema, with ``ErrorBody`` for each 4xx (and the bucket's 502, the store's 503, a full disk's 507) of each operation
    (``api.errors``' module doc)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorBody.model_json_schema(ref_template="#/components/schemas/{model}", mode="serialization")
    for name, definition in {**error_schema.pop("$defs"), "ErrorBody": error_schema}.items():
        components.setdefault(name, definition)
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.setdefault("responses", {})
            if "4XX" in responses:  # documents its own error bodies (the /v1 facade's OpenAI shape)
                continue
            statuses = [int(s) for s in responses if s.startswith("4")]
            if path in PUBLIC_PATHS:
                operation["security"] = []  # no key needed (the app-wide dependency lists the scheme everywhere)
            else:
                statuses += [
                    401,
                    429,
                    502,
                    503,
                    507,
                ]  # no valid key; its rate; the bucket; the store's write lock; a full disk
            if operation.get("parameters") or operation.get("requestBody"):
                statuses.append(422)
            if operation.get("requestBody"):
                statuses.append(400)  # a body that cannot be decoded at all
            if "{" in path:
                statuses.append(404)
            for status in sorted(set(statuses)):
                entry = responses.setdefault(str(status), {"description": ERROR_STATUSES.get(status, "Client error.")})
                if entry.get("description") == "Validation Error":
                    entry["description"] = ERROR_STATUSES[422]
                entry["content"] = ref
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    app.openapi_schema = schema
    return schema
