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
