"""The code base stays lint-clean (ruff, with the rules configured in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing_in_package_tests_and_scripts() -> None:
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "webhook", "tests", "scripts"],
                            cwd=ROOT, capture_output=True, text=True, timeout=120,
                            check=False)
    assert result.returncode == 0, result.stdout + result.stderr
