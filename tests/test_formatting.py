"""The formatter's check: `ruff format` and ruff's lint rules with its import sorter (pyproject.toml,
[tool.ruff]) leave ember/, tests/, scripts/ and setup.py unchanged. `make format` applies both."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREES = ["ember", "tests", "scripts", "setup.py"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args, *TREES], cwd=ROOT, capture_output=True, text=True)


def test_the_tree_is_formatted():
    result = _ruff("format", "--check")
    assert result.returncode == 0, f"run `make format`:\n{result.stdout}{result.stderr}"


def test_imports_sorted_and_lint_clean():
    result = _ruff("check")
    assert result.returncode == 0, f"run `make format` (or fix by hand what it cannot):\n{result.stdout}{result.stderr}"
