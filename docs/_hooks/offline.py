"""MkDocs hook: the site asks no other host for anything.

Material's ``offline`` plugin inlines the search index, but adds one script from a CDN (the
``iframe-worker`` shim from unpkg.com, which lets search run from ``file://``); this hook takes
that URL out again, so search works when the site is served over HTTP (``python -m http.server
-d site``) and the rest of the site works from ``file://`` too. After the build it reads every
HTML page and stylesheet and fails the build if one still loads a script, stylesheet, font, image
or frame from another host.
"""

from __future__ import annotations

import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.plugins import event_priority

# What a page or stylesheet *loads*: src=, <link href=> (stylesheets, icons, preconnects), CSS url()
# and @import. Plain <a href> links to other sites are allowed: following one is the reader's choice.
LOADS = re.compile(
    r"""<(?:script|img|iframe|source|audio|video|embed)\b[^>]*?\bsrc\s*=\s*["']?([^"'\s>]+)"""
    r"""|<link\b[^>]*?\bhref\s*=\s*["']?([^"'\s>]+)"""
    r"""|url\(\s*["']?([^"')\s]+)"""
    r"""|@import\s+["']([^"']+)""",
    re.IGNORECASE,
)
EXTERNAL = re.compile(r"^(?:[a-z][a-z0-9+.-]*:)?//", re.IGNORECASE)


@event_priority(-100)  # after Material's offline plugin has added its polyfill
def on_config(config):
    polyfills = config.extra.get("polyfills", [])
    config.extra["polyfills"] = [url for url in polyfills if not EXTERNAL.match(str(url))]
    return config


def external_loads(site_dir: str | Path) -> list[str]:
    """``"page: url"`` for every resource a built page or stylesheet loads from another host."""
    found = []
    for path in sorted(Path(site_dir).rglob("*")):
        if path.suffix not in (".html", ".css") or not path.is_file():
            continue
        for match in LOADS.finditer(path.read_text(encoding="utf-8", errors="replace")):
            url = next(group for group in match.groups() if group)
            if EXTERNAL.match(url):
                found.append(f"{path.relative_to(site_dir)}: {url}")
    return found


@event_priority(-200)  # after every other post-build step (the offline plugin's included)
def on_post_build(config):
    found = external_loads(config.site_dir)
    if found:
        raise PluginError("the site loads from other hosts:\n  " + "\n  ".join(found[:20]))
