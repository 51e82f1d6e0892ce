"""README.md is built from docs/ (no hand edits drift) and opens with the two commands."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_readme_is_built_from_its_sources():
    builder = str(ROOT / "docs" / "build_readme.py")
    check = subprocess.run([sys.executable, builder, "--check"], check=False)
    assert check.returncode == 0, "README.md is stale: run python docs/build_readme.py"


def test_readme_opens_with_the_demo_and_test_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    commands = [line.split("#")[0].strip() for line in lines[:8] if line.startswith("make ")]
    assert commands == ["make demo", "make test"]
