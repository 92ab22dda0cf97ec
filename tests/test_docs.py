"""The documentation points at things that exist, and every package lists its modules.

Markdown links and the file paths the docs name (README.md, BENCHMARKS.md, docs/*.md) must
resolve in this checkout, and so must the documents the code refers to; each package's
`__init__.py` docstring names every module of the package with a one-liner and names none that
is gone.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGE_ROOTS = ["pdserve", "router", "prefill_service", "decode_service", "kv_transfer"]
GENERATED_PACKAGES = {ROOT / "pdserve" / "pb"}  # generated code, described by its own docstring
SKIPPED_DIRS = {".git", "__pycache__", ".venv", "node_modules", ".pytest_cache", ".ruff_cache"}

LINK = re.compile(r"\]\(([^)\s]+)\)")
# A path the text names: a word ending in a file extension we keep docs about, or any `*.md`.
NAMED_PATH = re.compile(r"(?<![\w/.:<>-])([\w.-]+(?:/[\w.-]+)*\.(?:md|py|proto|yaml|yml|toml))\b")
MODULE_NAME = re.compile(r"(?<![\w/.])(\w+\.py)\b")


def _repo_files() -> list[str]:
    files = []
    for path in ROOT.rglob("*"):
        if path.is_file() and not SKIPPED_DIRS & set(path.relative_to(ROOT).parts):
            files.append(path.relative_to(ROOT).as_posix())
    return files


@pytest.fixture(scope="module")
def repo_files() -> list[str]:
    return _repo_files()


def _exists(name: str, doc: Path, repo_files: list[str]) -> bool:
    """As a path from the repository root or from the document, or as the tail of a repository
    path (docs say `policy.py` inside a paragraph about router/, or `examples/x.yaml` inside one
    about the chart)."""
    if (ROOT / name).exists() or (doc.parent / name).exists():
        return True
    return any(f == name or f.endswith("/" + name) for f in repo_files)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_markdown_links_resolve(doc: Path) -> None:
    broken = []
    for target in LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the same page
        if not (doc.parent / target.split("#", 1)[0]).exists():
            broken.append(target)
    assert not broken, f"{doc.name}: links to missing files: {broken}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_files_the_docs_name_exist(doc: Path, repo_files: list[str]) -> None:
    text = doc.read_text(encoding="utf-8")
    missing = sorted(
        {
            name
            for name in NAMED_PATH.findall(text)
            if "*" not in name and not _exists(name, doc, repo_files)
        }
    )
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


def _sources() -> list[Path]:
    return [path for root in PACKAGE_ROOTS for path in sorted((ROOT / root).rglob("*.py"))]


def test_documents_named_in_the_code_exist(repo_files: list[str]) -> None:
    """Docstrings and comments that send the reader to a document name one that is here."""
    missing = [
        f"{path.relative_to(ROOT)}: {name}"
        for path in _sources()
        for name in set(NAMED_PATH.findall(path.read_text(encoding="utf-8")))
        if name.endswith(".md") and not _exists(name, path, repo_files)
    ]
    assert not missing, f"the code points at documents that do not exist: {missing}"


def _packages() -> list[Path]:
    found = []
    for root in PACKAGE_ROOTS:
        for init in sorted((ROOT / root).rglob("__init__.py")):
            if init.parent not in GENERATED_PACKAGES and "__pycache__" not in init.parts:
                found.append(init.parent)
    return found


@pytest.mark.parametrize("package", _packages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_package_docstring_lists_exactly_its_modules(package: Path) -> None:
    docstring = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    assert docstring, f"{package.name}/__init__.py has no docstring"
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    named = set(MODULE_NAME.findall(docstring))
    assert not modules - named, f"{package.name}: modules without a one-liner: {modules - named}"
    assert not named - modules, (
        f"{package.name}: docstring names missing modules: {named - modules}"
    )


METRIC_NAME = re.compile(r"`((?:pdserve_|vllm:)[\w:]+)")


def test_metric_names_the_troubleshooting_guide_gives_are_exported() -> None:
    """An operator searching Prometheus for a name docs/troubleshooting.md gives finds it.
    (docs/metrics.md also names vLLM's metrics that pdserve does not export, on purpose.)"""
    from prometheus_client import REGISTRY

    import pdserve.metrics  # noqa: F401  (registers every metric)

    exported = {sample for metric in REGISTRY.collect() for sample in _sample_names(metric)}
    text = (ROOT / "docs" / "troubleshooting.md").read_text(encoding="utf-8")
    named = set(METRIC_NAME.findall(text))
    assert len(named) >= 10
    assert not named - exported, f"names no process exports: {named - exported}"


def _sample_names(metric) -> set[str]:
    """The names a metric is scraped under (a counter's `_total`, a histogram's `_bucket` ...),
    and its own."""
    return (
        {metric.name}
        | {sample.name for sample in metric.samples}
        | {metric.name + suffix for suffix in ("_total", "_bucket", "_count", "_sum", "_created")}
    )
