"""The layering of the code: the API and the client load nothing of the worker (torch, the training
recipe), so an API process stays small and the client starts fast; both reach the queue through
``shared.queue``."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["api.main", "client.cli", "shared.queue"])
def test_module_imports_nothing_from_the_worker(module):
    code = (f"import sys, {module}; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('worker', 'torch')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", f"{module} loads {loaded.strip()}"


def test_the_images_copy_every_package():
    """Each image installs the project from the packages it copies: one left out (as the new
    ``tunejob/`` once was) would break ``pip install`` or the ``tunejob`` command in the image."""
    import re
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = {p.split(".")[0] for p in setuptools["packages"]}
    for dockerfile in ("Dockerfile", "Dockerfile.gpu"):
        copied = set(re.findall(r"^COPY (\w+)/ \1/$", (root / dockerfile).read_text(), re.MULTILINE))
        assert packages <= copied, f"{dockerfile} does not copy {sorted(packages - copied)}"
