"""The layering of the code: the API and the client load nothing of the worker (torch, the training
recipe), so an API process stays small and the client starts fast; both reach the queue through
``shared.queue``."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["api.main", "client.cli", "shared.queue"])
def test_module_imports_nothing_from_the_worker(module):
    code = f"import sys, {module}; print(sorted(m for m in sys.modules if m.split('.')[0] in ('worker', 'torch')))"
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


# Which parts of ``shared/`` each part may import (README, "Code layout"): the store and the data
# at the bottom, side by side; the scoring loop on the data; the job lifecycle on all of them; the
# queue on top. ``errors``, ``schemas`` and ``settings`` are the foundation everyone may use.
FOUNDATION = {"errors", "schemas", "settings"}
MAY_IMPORT = {
    "errors": set(),
    "schemas": set(),
    "settings": {"schemas"},
    "logs": {"errors", "settings"},
    "store": FOUNDATION,
    "data": FOUNDATION,
    "inference": FOUNDATION | {"data"},
    "jobs": FOUNDATION | {"store", "data", "inference"},
    "queue": FOUNDATION | {"logs", "store", "data", "inference", "jobs"},
}


def _shared_imports(path):
    """The parts of ``shared/`` (``store``, ``data``, ...) that the module at ``path`` imports."""
    import ast

    parts = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = (
            [node.module]
            if isinstance(node, ast.ImportFrom) and node.module
            else [a.name for a in node.names]
            if isinstance(node, ast.Import)
            else []
        )
        for name in names:
            if name.startswith("shared."):
                parts.add(name.split(".")[1])
            elif name == "shared":  # from shared import x
                parts.update(a.name for a in node.names)
    return parts


def test_shared_imports_run_one_way():
    """``shared/`` is layered (store and data at the bottom, jobs above, the queue on top): a module
    importing upwards, or across the store and the data, fails here, so no import circle can form."""
    from pathlib import Path

    shared = Path(__file__).resolve().parent.parent / "shared"
    wrong = []
    for path in sorted(shared.rglob("*.py")):
        rel = path.relative_to(shared)
        part = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        if part == "__init__":
            continue
        allowed = MAY_IMPORT[part] | {part}
        wrong += [f"shared/{rel} imports shared.{p}" for p in sorted(_shared_imports(path) - allowed)]
    assert not wrong, wrong


PACKAGES = ("api", "bench", "client", "migrations", "shared", "tunejob", "worker")


def import_graph(root):
    """Each module of ``PACKAGES`` under ``root`` (dotted name) -> the project's modules it imports,
    anywhere in its code (inside functions too: such an import only hides a circle). ``from p import
    m`` counts as importing module ``p.m`` where that is a module, else package ``p``."""
    import ast

    files = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def module(name):
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                imported |= {module(a.name) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the package, up level - 1
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                imported |= {module(f"{base}.{a.name}") for a in node.names}
        graph[name] = imported - {"", name}
    return graph


def circles(graph):
    """The import circles of ``graph``: its strongly connected components of more than one module
    (Tarjan's algorithm, iterative), each sorted."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while (member := stack.pop()) != node:
                        component.add(member)
                    component.add(node)
                    on_stack -= component
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_no_import_circles():
    """No import circle anywhere in the project: each module imports only modules below it, even
    inside a function, so each can be read, tested and moved on its own (issue 35)."""
    from pathlib import Path

    graph = import_graph(Path(__file__).resolve().parent.parent)
    assert {"api.auth", "shared.jobs.lifecycle", "worker.training.recipe"} <= graph.keys()  # the walk found the code
    assert not circles(graph), circles(graph)


def test_the_circle_check_finds_a_circle_hidden_in_a_function(tmp_path):
    """The check sees an import inside a function, and a relative one."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "shared" / "__init__.py").write_text("")
    (tmp_path / "shared" / "a.py").write_text("from shared import b\n")
    (tmp_path / "shared" / "b.py").write_text("def f():\n    from . import c\n")
    (tmp_path / "shared" / "c.py").write_text("import shared.a\n")
    (tmp_path / "shared" / "d.py").write_text("from shared.a import x\n")  # imports into the circle, not part of it
    assert circles(import_graph(tmp_path)) == [["shared.a", "shared.b", "shared.c"]]


def test_no_module_in_shared_is_long():
    """Short modules (issue 28): none in ``shared/`` over about 500 lines."""
    from pathlib import Path

    shared = Path(__file__).resolve().parent.parent / "shared"
    long = {str(p.relative_to(shared)): n for p in shared.rglob("*.py") if (n := len(p.read_text().splitlines())) > 550}
    assert not long, long


def test_no_module_in_worker_is_long():
    """Short modules (issue 35): none in ``worker/`` over 400 lines; the training recipe is a package
    of one module per job (``worker/training/``), not one long file."""
    from pathlib import Path

    worker = Path(__file__).resolve().parent.parent / "worker"
    long = {str(p.relative_to(worker)): n for p in worker.rglob("*.py") if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def test_the_training_parts_never_import_the_recipe():
    """Only the recipe (``worker/training/recipe.py``) assigns the parts that train; the modules it
    calls (capture, checks, state, export, metrics, progress) take parts and return new ones, and
    none of them imports the recipe, not even inside a function: no import circle."""
    import ast
    from pathlib import Path

    training = Path(__file__).resolve().parent.parent / "worker" / "training"
    wrong = []
    for path in sorted(training.glob("*.py")):
        if path.stem == "recipe":
            continue
        tree = ast.parse(path.read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        imported |= {
            f"{n.module}.{a.name}"
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.module
            for a in n.names
        }
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        wrong += [
            f"worker/training/{path.name} imports {m}"
            for m in sorted(imported)
            if m == "worker.training.recipe" or m.startswith("worker.training.recipe.")
        ]
    assert not wrong, wrong
