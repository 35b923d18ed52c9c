"""The house's floors: package layering, no cycles, pure cores free of I/O.

The contracts live in ``pyproject.toml`` (``[tool.importlinter]``) and are checked by
import-linter (grimp builds the import graph, counting ``TYPE_CHECKING`` and function-level
imports: a cycle through an annotation or a lazy import is still a cycle of design). Each
contract's ``ignore_imports`` is a ratchet: today's violations, one import per line, deleted
as each is fixed. A fixed violation whose line is still listed fails too
(``unmatched_ignore_imports_alerting = "error"``), so the lists only shrink.

Two rules import-linter cannot say are checked here with grimp's graph:

- no module imports the bare root package ``dsec`` (its ``TYPE_CHECKING`` block imports the
  client, so ``import dsec`` from an edge module is an upward import in disguise);
- the pure cores (CONVENTIONS #1: pure logic separate from I/O) import no I/O module,
  directly or through any other module.

The self-tests plant each kind of violation in a throwaway package and check it is reported,
so none of these checks can pass by being unable to fail.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterable
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]

# Modules whose logic must stay pure: decisions as data, no sockets, processes, files, clocks.
PURE_MODULES = (
    "dsec.aether.frame",
    "dsec.aether.state",
    "dsec.control.placement",
    "dsec.control.watcher",
    "dsec.control.sweeper",
    "dsec.control.quota",
    "dsec.control.reconcile",
    "dsec.edge.lifecycle",
)
# Packages whose every module is pure (checked once they exist: the vocabulary, issue 13).
PURE_PACKAGES = ("dsec.wire",)
IO_MODULES = frozenset({
    "asyncio", "socket", "selectors", "subprocess", "threading", "multiprocessing",
    "os", "shutil", "sqlite3", "time", "httpx", "starlette", "uvicorn", "uvloop",
})

# The ratchet for the root-package rule: importer modules allowed to `import dsec` today.
ROOT_IMPORTERS_ALLOWED: frozenset[str] = frozenset()


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(pythonpath), *filter(None, [os.environ.get("PYTHONPATH")])]))
    return subprocess.run(
        [sys.executable, "-c",
         "from importlinter.cli import lint_imports_command; lint_imports_command()",
         "pyproject.toml", "--no-cache", "--no-logo"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False,
    )


def _graph(package: str) -> grimp.ImportGraph:
    return grimp.build_graph(package, exclude_type_checking_imports=False,
                             include_external_packages=True, cache_dir=None)


def root_importers(graph: grimp.ImportGraph, root: str) -> set[str]:
    """Modules of ``root`` that import the bare root package itself."""
    return {m for m in graph.find_modules_that_directly_import(root) if m.startswith(root + ".")}


def impure(graph: grimp.ImportGraph, modules: Iterable[str]) -> dict[str, list[str]]:
    """For each module, the I/O modules it reaches (directly or through others), if any."""
    out: dict[str, list[str]] = {}
    for m in modules:
        if m not in graph.modules:
            raise AssertionError(f"pure module {m} does not exist: update PURE_MODULES")
        reached = sorted(u for u in graph.find_upstream_modules(m) if u in IO_MODULES)
        if reached:
            chains = [" -> ".join(graph.find_shortest_chain(m, u) or ()) for u in reached]
            out[m] = chains
    return out


def pure_modules(graph: grimp.ImportGraph) -> list[str]:
    found = [m for p in PURE_PACKAGES if p in graph.modules
             for m in sorted(graph.find_descendants(p) | {p})]
    return [*PURE_MODULES, *found]


# ---------------------------------------------------------------------------- the real tree


def test_import_contracts_hold() -> None:
    r = _lint(ROOT, ROOT / "src")
    assert r.returncode == 0, (
        "import contracts broken (pyproject.toml [tool.importlinter]); fix the import, or if a "
        "listed violation was fixed, delete its ignore_imports line:\n" + r.stdout + r.stderr)
    assert "0 broken" in r.stdout


@pytest.fixture(scope="module")
def dsec_graph() -> grimp.ImportGraph:
    return _graph("dsec")


def test_no_module_imports_the_root_package(dsec_graph: grimp.ImportGraph) -> None:
    found = root_importers(dsec_graph, "dsec")
    assert found <= ROOT_IMPORTERS_ALLOWED, (
        f"{sorted(found - ROOT_IMPORTERS_ALLOWED)} import the root package `dsec` (whose "
        "TYPE_CHECKING block imports the SDK): import the submodule you need instead")
    assert ROOT_IMPORTERS_ALLOWED <= found, (
        f"{sorted(ROOT_IMPORTERS_ALLOWED - found)} no longer import `dsec`: delete them from "
        "ROOT_IMPORTERS_ALLOWED (the ratchet only shrinks)")


def test_pure_cores_do_no_io(dsec_graph: grimp.ImportGraph) -> None:
    bad = impure(dsec_graph, pure_modules(dsec_graph))
    assert not bad, "pure cores reach I/O modules:\n" + "\n".join(
        f"  {m}: {', '.join(chains)}" for m, chains in bad.items())


# ---------------------------------------------------------------------------- self-tests


def _plant(tmp: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = tmp / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))


_CONFIG = """
[tool.importlinter]
root_package = "pkg"
exclude_type_checking_imports = false

[[tool.importlinter.contracts]]
id = "floors"
name = "floors"
type = "layers"
containers = ["pkg"]
layers = ["high", "mid | side", "low"]
exhaustive = true
unmatched_ignore_imports_alerting = "error"
ignore_imports = [{floors_ignore}]

[[tool.importlinter.contracts]]
id = "high-not-side"
name = "high reaches side only through mid"
type = "forbidden"
source_modules = ["pkg.high"]
forbidden_modules = ["pkg.side"]
allow_indirect_imports = true
unmatched_ignore_imports_alerting = "error"
ignore_imports = []

[[tool.importlinter.contracts]]
id = "acyclic"
name = "acyclic"
type = "acyclic_siblings"
ancestors = ["pkg"]
depth = 10
unmatched_ignore_imports_alerting = "error"
ignore_imports = []
"""

_CLEAN = {
    "pkg/__init__.py": "",
    "pkg/high.py": "import pkg.mid\n",
    "pkg/mid/__init__.py": "",
    "pkg/mid/a.py": "import pkg.low\n",
    "pkg/mid/b.py": "from pkg.mid import a\n",
    "pkg/side.py": "import pkg.low\n",
    "pkg/low.py": "import json\n",
}


def _run_planted(tmp: Path, extra: dict[str, str], floors_ignore: str = "") -> str:
    _plant(tmp, {**_CLEAN, **extra})
    (tmp / "pyproject.toml").write_text(_CONFIG.format(floors_ignore=floors_ignore))
    r = _lint(tmp, tmp)
    return f"rc={r.returncode}\n{r.stdout}{r.stderr}"


def test_self_test_clean_package_passes(tmp_path: Path) -> None:
    out = _run_planted(tmp_path, {})
    assert out.startswith("rc=0"), out


def test_self_test_upward_import_is_reported(tmp_path: Path) -> None:
    # a lazy, function-level upward import counts
    out = _run_planted(tmp_path, {"pkg/low.py": "def f():\n    import pkg.high\n"})
    assert out.startswith("rc=1") and "pkg.low is not allowed to import pkg.high" in out, out


def test_self_test_sibling_import_is_reported(tmp_path: Path) -> None:
    out = _run_planted(tmp_path, {"pkg/side.py": "import pkg.mid.a\n"})
    assert out.startswith("rc=1") and "pkg.side is not allowed to import pkg.mid" in out, out


def test_self_test_forbidden_import_is_reported(tmp_path: Path) -> None:
    # allowed by the floors (side is below high), refused by the forbidden contract
    out = _run_planted(tmp_path, {"pkg/high.py": "import pkg.mid\nimport pkg.side\n"})
    assert out.startswith("rc=1") and "pkg.high is not allowed to import pkg.side" in out, out


def test_self_test_cycle_through_type_checking_is_reported(tmp_path: Path) -> None:
    out = _run_planted(tmp_path, {"pkg/mid/a.py": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.mid import b\n")})
    assert out.startswith("rc=1") and "No cycles are allowed in pkg.mid" in out, out


def test_self_test_unfloored_package_is_reported(tmp_path: Path) -> None:
    out = _run_planted(tmp_path, {"pkg/extra.py": ""})
    assert out.startswith("rc=1") and "pkg.extra" in out, out


def test_self_test_stale_ratchet_line_is_reported(tmp_path: Path) -> None:
    out = _run_planted(tmp_path, {}, floors_ignore='"pkg.low -> pkg.high"')
    assert out.startswith("rc=1") and "pkg.low -> pkg.high" in out, out


def test_self_test_root_import_and_impure_core_are_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _plant(tmp_path, {
        "rootpkg/__init__.py": "",
        "rootpkg/core.py": "from rootpkg import helper\n",
        "rootpkg/helper.py": "import rootpkg\n\ndef f():\n    import subprocess\n",
        "rootpkg/clean.py": "import json\n",
    })
    monkeypatch.syspath_prepend(str(tmp_path))
    g = _graph("rootpkg")
    assert root_importers(g, "rootpkg") == {"rootpkg.helper"}
    bad = impure(g, ["rootpkg.core", "rootpkg.clean"])
    assert list(bad) == ["rootpkg.core"]
    assert bad["rootpkg.core"] == ["rootpkg.core -> rootpkg.helper -> subprocess"]
    with pytest.raises(AssertionError, match="does not exist"):
        impure(g, ["rootpkg.gone"])
