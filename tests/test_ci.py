"""`.ci/run` tests what a new user gets: a fresh virtual environment, then exactly the README's
test command in it, so a package installed by hand on the CI machine cannot hide one the
`test` extra lacks."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_test_command() -> list[str]:
    """The README's "Test it" command, split at its `&&` into the steps it runs."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Test it:\s*```bash\n(.+?)\n```", readme, re.S)
    assert block, "README.md lost its 'Test it:' block"
    return [step.strip() for step in block.group(1).split("&&")]


def ci_steps() -> list[str]:
    lines = (ROOT / ".ci/run").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_ci_runs_the_readmes_test_command_in_a_fresh_virtual_environment() -> None:
    steps = ci_steps()
    venv = next((i for i, s in enumerate(steps) if re.search(r"python3? -m venv ", s)), None)
    assert venv is not None, ".ci/run does not create a virtual environment"
    activate = next((i for i, s in enumerate(steps) if re.search(r"/bin/activate\"?$", s)), None)
    assert activate is not None and activate > venv, ".ci/run does not enter its environment"
    position = activate
    for step in readme_test_command():
        assert step in steps[position + 1 :], f".ci/run lacks the README's step {step!r}"
        position = steps.index(step, position + 1)


def test_ci_runs_the_static_checks_the_readme_names() -> None:
    steps = ci_steps()
    for check in ("ruff check .", "ruff format --check .", "lint-imports"):
        assert check in steps
