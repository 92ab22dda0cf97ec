"""`pip install -e '.[test]'` (the README's test command) installs everything the tests import:
each third-party module imported by a test module belongs to a distribution that
`[project.dependencies]` or the `test` extra declares by name (through `pdserve[...]` extras
too). A dependency of a dependency does not count: it can go away with the next release."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement

from tests.test_runtime_imports import RUNTIME_PACKAGES, canonical, imported_modules

ROOT = Path(__file__).resolve().parents[1]
FIRST_PARTY = {*RUNTIME_PACKAGES, "tests"}


def declared_for_tests(project: dict) -> set[str]:
    """The distributions named by the dependencies and the `test` extra, following the
    project's own extras (`pdserve[nixl]`) to the names they declare."""
    extras = project["optional-dependencies"]
    names: set[str] = set()
    pending = [Requirement(r) for r in (*project["dependencies"], *extras["test"])]
    seen_extras: set[str] = {"test"}
    while pending:
        requirement = pending.pop()
        name = canonical(requirement.name)
        if name != canonical(project["name"]):
            names.add(name)
            continue
        for extra in requirement.extras - seen_extras:
            seen_extras.add(extra)
            pending += [Requirement(r) for r in extras[extra]]
    return names


def skipped_imports(path: Path) -> set[str]:
    """Modules a test imports through `pytest.importorskip("name")`: a missing one skips the
    test silently, so it must be declared as much as a plain import."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "importorskip"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            names.add(str(node.args[0].value).split(".")[0])
    return names


def undeclared_test_imports(project: dict) -> dict[str, str]:
    """Module → the first test file importing it, for each module no declared distribution
    provides."""
    declared = declared_for_tests(project)
    distributions = packages_distributions()
    missing: dict[str, str] = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for module in sorted(imported_modules(path) | skipped_imports(path)):
            if module in sys.stdlib_module_names or module in FIRST_PARTY:
                continue
            # Not installed here: the module's own name is the best guess at its distribution.
            owners = {canonical(d) for d in distributions.get(module, [module])}
            if not owners & declared:
                missing.setdefault(module, str(path.relative_to(ROOT)))
    return missing


def test_every_test_import_is_declared_for_the_test_install() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    missing = undeclared_test_imports(project)
    assert missing == {}, f"imported by the tests but not declared in the `test` extra: {missing}"


def test_a_test_only_import_outside_the_test_extra_is_caught() -> None:
    """The check itself: scipy (imported by the sampler's statistical tests) is reported once
    the `test` extra no longer names it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    test_extra = project["optional-dependencies"]["test"]
    project["optional-dependencies"]["test"] = [
        r for r in test_extra if canonical(Requirement(r).name) != "scipy"
    ]
    assert "scipy" in undeclared_test_imports(project)
