"""Swagger UI (``/docs``) and ReDoc (``/redoc``) work without internet: the pages reference no
external URL, and every script, stylesheet, icon and the OpenAPI document they load is served by
the API itself."""

import re

import pytest
from fastapi.testclient import TestClient

from tests.conftest import BASE_URL

# src/href/spec-url attributes, and Swagger UI's `url: '...'` option (the OpenAPI document).
REFERENCE = re.compile(r"""(?:src|href|spec-url)\s*=\s*["']([^"']+)["']|\burl\s*:\s*["']([^"']+)["']""")
EXTERNAL = re.compile(r"""(?:https?:)?//[A-Za-z0-9.-]+\.[A-Za-z]{2,}""")


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("TUNEJOB_DATA_DIR", str(tmp_path_factory.mktemp("data")))  # nothing under ~/.tunejob
        from api.main import create_app
        from shared.settings import get_settings

        get_settings.cache_clear()
        yield TestClient(create_app(), base_url=BASE_URL)  # the docs need no job store: the lifespan is not run
        get_settings.cache_clear()


@pytest.mark.parametrize(
    "page, expected",
    [
        ("/docs", {"swagger-ui-bundle.js", "swagger-ui.css", "openapi.json"}),
        ("/redoc", {"redoc.standalone.js", "openapi.json"}),
    ],
)
def test_docs_page_loads_only_local_assets(client, page, expected):
    r = client.get(page)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert EXTERNAL.findall(r.text) == []
    references = {a or b for a, b in REFERENCE.findall(r.text)}
    assert {ref.rsplit("/", 1)[-1] for ref in references} >= expected, references
    for ref in references:
        assert ref.startswith("/"), ref  # served by this API, whatever host it is reached at
        asset = client.get(ref)
        assert asset.status_code == 200 and len(asset.content) > 1000, (ref, asset.status_code)
        if ref.endswith(".js"):
            assert "javascript" in asset.headers["content-type"]
        elif ref.endswith(".css"):
            assert asset.headers["content-type"].startswith("text/css")
        elif ref.endswith(".json"):
            assert "/v1/fine_tuning/jobs" in asset.json()["paths"]
