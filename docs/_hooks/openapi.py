"""MkDocs hook: the API reference from the app itself, offline.

At every build it imports ``api.main``, asks the FastAPI app for its OpenAPI document
(``app.openapi()``, the same one a running service serves at ``/openapi.json``) and adds two
generated files to the site: ``reference/openapi.json`` (the document, to download or feed to a
client generator) and ``reference/openapi.md`` (every operation and schema as Markdown tables).
No JavaScript viewer and nothing fetched from another host; nothing is written into ``docs/``.
"""

from __future__ import annotations

import json
import os
import tempfile

from mkdocs.structure.files import File

PAGE = "reference/openapi.md"
DOCUMENT = "reference/openapi.json"
METHODS = ("get", "post", "put", "patch", "delete")


def openapi_document() -> dict:
    """The app's OpenAPI document, built without a job store (the app's lifespan does not run)."""
    with tempfile.TemporaryDirectory() as data_dir:
        previous = os.environ.get("TUNEJOB_DATA_DIR")
        os.environ["TUNEJOB_DATA_DIR"] = data_dir  # nothing under ~/.tunejob
        try:
            from api.main import create_app
            from shared.settings import get_settings

            get_settings.cache_clear()
            return create_app().openapi()
        finally:
            if previous is None:
                os.environ.pop("TUNEJOB_DATA_DIR", None)
            else:
                os.environ["TUNEJOB_DATA_DIR"] = previous
            get_settings.cache_clear()


def cell(text) -> str:
    """One Markdown table cell: no newlines, no unescaped pipes."""
    return " ".join(str(text or "").split()).replace("|", "\\|")


def type_of(schema: dict) -> str:
    """A short type name: ``string``, ``integer[]``, ``JobOut``, ``string | null``."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[`{name}`](#{name.lower()})"
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            return " \\| ".join(type_of(s) for s in schema[key])
    if schema.get("type") == "array":
        return "array of " + type_of(schema.get("items", {}))
    if "enum" in schema:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in schema["enum"])
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    return f"`{schema.get('type', 'any')}`"


def operation_markdown(path: str, method: str, op: dict) -> list[str]:
    out = [f"### `{method.upper()} {path}`", ""]
    if op.get("summary"):
        out += [f"**{op['summary']}**", ""]
    if op.get("description"):
        # The docstrings use RST's double backticks; Markdown reads single ones.
        out += [op["description"].replace("``", "`"), ""]
    if op.get("parameters"):
        out += ["| parameter | in | type | required | description |", "| --- | --- | --- | --- | --- |"]
        for p in op["parameters"]:
            out.append(
                f"| `{p['name']}` | {p['in']} | {type_of(p.get('schema', {}))} | "
                f"{'yes' if p.get('required') else 'no'} | {cell(p.get('description'))} |"
            )
        out.append("")
    body = op.get("requestBody", {}).get("content", {})
    for media, content in body.items():
        out += [f"Request body ({media}): {type_of(content.get('schema', {}))}", ""]
    if op.get("responses"):
        out += ["| status | description | body |", "| --- | --- | --- |"]
        for status, response in op["responses"].items():
            content = response.get("content", {})
            schemas = ", ".join(type_of(c.get("schema", {})) for c in content.values() if c.get("schema"))
            out.append(f"| {status} | {cell(response.get('description'))} | {schemas} |")
        out.append("")
    return out


def schema_markdown(name: str, schema: dict) -> list[str]:
    out = [f"### {name}", ""]
    if schema.get("description"):
        out += [schema["description"].replace("``", "`"), ""]
    properties = schema.get("properties", {})
    if properties:
        required = set(schema.get("required", []))
        out += ["| field | type | required | description |", "| --- | --- | --- | --- |"]
        for field, prop in properties.items():
            out.append(
                f"| `{field}` | {type_of(prop)} | {'yes' if field in required else 'no'} | "
                f"{cell(prop.get('description'))} |"
            )
        out.append("")
    elif "enum" in schema or "type" in schema:
        out += [f"Type: {type_of(schema)}", ""]
    return out


def render(document: dict) -> str:
    info = document["info"]
    out = [
        "# HTTP API (OpenAPI)",
        "",
        f"Generated at build time from the app itself (`api.main.create_app().openapi()`): "
        f"{info['title']} {info['version']}, OpenAPI {document['openapi']}. "
        "The same document is served by a running service at `/openapi.json`, with Swagger UI at "
        "`/docs` and ReDoc at `/redoc` (both offline). Download it here: "
        "[openapi.json](openapi.json).",
        "",
        info.get("description", ""),
        "",
        "Every 4xx answer has the body [`ErrorBody`](#errorbody): "
        '`{"error": {"code", "message", "param", "problems"}}` '
        "(see [Jobs: errors](../guide/jobs.md#errors)).",
        "",
    ]
    by_tag: dict[str, list[tuple[str, str, dict]]] = {}
    for path, item in document["paths"].items():
        for method in METHODS:
            if method in item:
                tag = (item[method].get("tags") or ["other"])[0]
                by_tag.setdefault(tag, []).append((path, method, item[method]))
    for tag, operations in by_tag.items():
        out += [f"## Operations: {tag}", ""]
        for path, method, op in operations:
            out += operation_markdown(path, method, op)
    out += ["## Schemas", ""]
    for name, schema in document.get("components", {}).get("schemas", {}).items():
        out += schema_markdown(name, schema)
    return "\n".join(out) + "\n"


def on_files(files, config):
    """Add the generated page and document to the site's files (nothing is written to docs/)."""
    document = openapi_document()
    files.append(File.generated(config, PAGE, content=render(document)))
    files.append(File.generated(config, DOCUMENT, content=json.dumps(document, indent=2)))
    return files
