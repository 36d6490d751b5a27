"""The documentation site builds offline and strict (``make docs``), asks no other host for
anything, presents the API's own OpenAPI document, and keeps its architecture picture drawn from
the source in the repository; the README stays a short front door with the two set-up commands."""

import hashlib
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs" / "_hooks"))
from offline import external_loads  # noqa: E402  (the build's own check, docs/_hooks/offline.py)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    site_dir = tmp_path_factory.mktemp("site")
    build(load_config(str(ROOT / "mkdocs.yml"), site_dir=str(site_dir), strict=True))
    return site_dir


def test_every_page_of_the_nav_is_built(site):
    import yaml

    def pages(nav):
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            yield from (pages(value) if isinstance(value, list) else [value])

    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.SafeLoader)
    for page in pages(config["nav"]):
        assert (site / page.replace(".md", ".html")).is_file(), page


def test_the_site_loads_nothing_from_another_host(site):
    assert list(site.rglob("*.html")), "no page built"
    assert external_loads(site) == []
    assert "unpkg.com" not in (site / "index.html").read_text()  # the offline plugin's CDN shim is taken out


def test_the_check_finds_what_a_page_would_fetch(tmp_path):
    (tmp_path / "page.html").write_text(
        '<script src="https://unpkg.com/shim"></script>'
        '<link rel="preconnect" href="//fonts.gstatic.com">'
        '<a href="https://example.com/">a link is fine</a><img src="img/local.svg">'
    )
    (tmp_path / "style.css").write_text("@font-face { src: url(https://fonts.gstatic.com/a.woff2) }")
    assert external_loads(tmp_path) == [
        "page.html: https://unpkg.com/shim",
        "page.html: //fonts.gstatic.com",
        "style.css: https://fonts.gstatic.com/a.woff2",
    ]


def test_the_reference_presents_the_apps_openapi_document(site):
    document = json.loads((site / "reference" / "openapi.json").read_text())
    assert "/v1/fine_tuning/jobs" in document["paths"] and "/jobs" in document["paths"]
    page = (site / "reference" / "openapi.html").read_text()
    for path in document["paths"]:
        assert path in page, path  # every operation has its section
    assert 'id="errorbody"' in page  # the schemas are there too


def test_every_example_of_the_api_reference_is_valid():
    """Each request and response example the OpenAPI document shows (``json_schema_extra``) is an
    instance of its own model: an example a client copies works, and a field added to a model
    without its example fails here (JobOut's lacked ``suffix`` and ``timings``)."""
    import importlib
    import inspect
    import pkgutil

    from pydantic import BaseModel

    import shared.schemas

    modules = [f"shared.schemas.{m.name}" for m in pkgutil.iter_modules(shared.schemas.__path__)]
    checked = 0
    for module in map(importlib.import_module, [*modules, "api.openai_compat", "api.openai_embeddings"]):
        for _, model in inspect.getmembers(module, inspect.isclass):
            extra = model.model_config.get("json_schema_extra") if issubclass(model, BaseModel) else None
            for example in extra.get("examples", []) if isinstance(extra, dict) else []:
                model.model_validate(example)  # raises, naming the model and the field
                checked += 1
    assert checked >= 19


def test_the_python_reference_is_generated_from_docstrings(site):
    page = (site / "reference" / "python.html").read_text()
    assert "doc-heading" in page and "shared.settings" in page


def test_the_architecture_picture_is_drawn_from_its_source():
    """``make diagram`` stamps the sha256 of docs/img/job-flow.dot into the SVG it renders."""
    source = (ROOT / "docs" / "img" / "job-flow.dot").read_bytes()
    svg = (ROOT / "docs" / "img" / "job-flow.svg").read_text()
    stamp = re.search(r"<!-- source sha256: ([0-9a-f]{64}) -->", svg)
    assert stamp, "job-flow.svg was not made by `make diagram`"
    assert stamp.group(1) == hashlib.sha256(source).hexdigest(), "job-flow.dot changed: run `make diagram`"


def test_the_readme_is_a_short_front_door():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert "make demo   #" in readme and "make test   #" in readme
    for target in re.findall(r"\]\(((?:docs/)[^)#]+)", readme):
        assert (ROOT / target).is_file(), target  # every link into docs/ names a file that exists


@pytest.mark.parametrize(
    "page", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md"))]
)
def test_every_code_block_is_closed(page):
    """An unclosed fence turns the rest of a page into code, which neither GitHub nor MkDocs reports."""
    fences = [line for line in (ROOT / page).read_text().splitlines() if line.lstrip().startswith("```")]
    assert len(fences) % 2 == 0, f"{page}: {len(fences)} fence lines"
