"""`pip install pdserve` (with its optional features, not its test tools) installs everything the
served code imports: each third-party module imported anywhere in the runtime packages belongs
to a declared dependency or to one of theirs."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import PackageNotFoundError, packages_distributions, requires
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_PACKAGES = ("pdserve", "router", "prefill_service", "decode_service", "kv_transfer")
TEST_ONLY_EXTRAS = {"test"}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_by(requirements: list[str]) -> set[str]:
    """The distributions these requirements install, dependencies of dependencies included."""
    seen: set[str] = set()
    pending = [Requirement(r) for r in requirements]
    while pending:
        requirement = pending.pop()
        if requirement.marker and not any(
            requirement.marker.evaluate({"extra": e}) for e in ("", *requirement.extras)
        ):
            continue
        name = canonical(requirement.name)
        key = name + "[" + ",".join(sorted(requirement.extras)) + "]"
        if key in seen:
            continue
        seen.add(key)
        try:
            theirs = requires(name) or []
        except PackageNotFoundError:
            continue  # an optional feature's package not installed here
        for text in theirs:
            dependency = Requirement(text)
            marker = dependency.marker
            wanted = marker is None or any(
                marker.evaluate({"extra": e}) for e in ("", *requirement.extras)
            )
            if wanted:
                dependency.marker = None
                pending.append(dependency)
    return {key.split("[")[0] for key in seen}


def imported_modules(path: Path) -> set[str]:
    """Top-level names of the absolute imports in a file, function-level ones included."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_every_third_party_import_is_installed_with_pdserve() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = list(project["dependencies"])
    for extra, requirements in project["optional-dependencies"].items():
        if extra not in TEST_ONLY_EXTRAS:
            declared += [r for r in requirements if canonical(Requirement(r).name) != "pdserve"]
    installed = installed_by(declared)
    distributions = packages_distributions()
    missing = {}
    for package in RUNTIME_PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            for module in imported_modules(path):
                if module in sys.stdlib_module_names or module in RUNTIME_PACKAGES:
                    continue
                owners = {canonical(d) for d in distributions.get(module, [module])}
                if not owners & installed:
                    missing.setdefault(module, str(path.relative_to(ROOT)))
    assert missing == {}, f"imported but not installed by pdserve's dependencies: {missing}"
