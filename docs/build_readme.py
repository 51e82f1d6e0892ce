"""Build README.md from docs/README.src.md, replacing each include marker by the file it names.

    python docs/build_readme.py          # write README.md
    python docs/build_readme.py --check  # exit 1 if README.md is out of date
"""

from __future__ import annotations

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MARKER = re.compile(r"^<!-- include: (\S+) -->$", re.MULTILINE)


def build() -> str:
    def include(match: re.Match) -> str:
        path = ROOT / match.group(1)
        if not path.exists():
            raise SystemExit(f"docs/build_readme.py: {match.group(1)} is missing; generate it first")
        text = path.read_text().rstrip("\n")
        if path.suffix == ".out":
            return "```text\n" + text + "\n```"
        return text

    return MARKER.sub(include, (ROOT / "docs" / "README.src.md").read_text())


def main() -> int:
    text = build()
    readme = ROOT / "README.md"
    if "--check" in sys.argv[1:]:
        return 0 if readme.exists() and readme.read_text() == text else 1
    readme.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
