"""The README and every documentation page: fresh, short enough, and their examples run.

Every ``python`` block of a page runs, in order, in one namespace per page, except a
block right after ``<!-- fragment -->`` (a line that needs the reader's own model) and a
block that is, to the character, a script whose output a page shows: that script runs in
`test_each_output_shown_comes_from_its_script` already (a later block reading its names
fails here).
The quick start's printed output is checked against the one the README shows.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "docs"))
import build_readme
import generate

BLOCK = re.compile(r"(<!-- fragment -->\n)?```python\n(.*?)```", re.DOTALL)
PAGES = ["README.md", *(f"docs/{page}" for page in build_readme.PAGES if page != "index.md")]


def blocks(page: str) -> list[str]:
    text = (ROOT / page).read_text()
    return [m.group(2) for m in BLOCK.finditer(text) if not m.group(1)]


def _scripts_shown() -> set[str]:
    """The text of every script whose output a page shows (run by the output test)."""
    found = set()
    for output in generate.OUTPUTS:
        words = output.command.split()
        if not output.slow and words[0] == "python" and (ROOT / words[1]).is_file():
            found.add((ROOT / words[1]).read_text().strip())
    return found


@pytest.mark.parametrize("page", [p for p in PAGES if blocks(p)])
def test_the_examples_of_each_page_run(page, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # examples may write files
    torch.manual_seed(0)
    namespace: dict = {"__name__": "__page__"}
    shown = _scripts_shown()
    for code in blocks(page):
        if code.strip() in shown:  # run as its script by the output test
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(code, page, "exec"), namespace)  # noqa: S102 (the page's own examples)


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move material to docs/sections"
    text = "\n".join(lines)
    for internal in ("seed 003", "the main job", "seed marks", "KNOWN_BROKEN", "fuzz"):
        assert internal not in text, internal
    for needed in ('remat.apply(model, where="blocks")', "remat.plan(", "pip install", ".venv",
                   "torch_remat", "remat[", "docs/quickstart.md"):
        assert needed.replace("remat[", '".[') in text or needed in text, needed


#: the project's own names for MindSpore's documentation pages, which a reader does not know
INTERNAL_WORDS = re.compile(r"seed 00\d|seeds 00\d|seed marks|seed's|the seed\b", re.IGNORECASE)


@pytest.mark.parametrize("page", [*PAGES, *(f"docs/outputs/{o.name}.out" for o in generate.OUTPUTS)])
def test_pages_and_outputs_speak_in_users_words(page):
    """MindSpore's pages by their titles ("MindSpore's recompute tutorial"), not as seeds."""
    found = INTERNAL_WORDS.findall((ROOT / page).read_text())
    assert not found, f"{page}: {sorted(set(found))}"


@pytest.mark.parametrize("output", [o for o in generate.OUTPUTS if not o.slow], ids=lambda o: o.name)
def test_each_output_shown_comes_from_its_script(output):
    """Deterministic outputs are shown exactly as their script prints them now; the others in shape."""
    shown = (ROOT / "docs" / "outputs" / f"{output.name}.out").read_text()
    printed = generate.run(output)
    if output.deterministic:
        assert printed == shown
    else:  # measured times differ: the same lines, numbers aside
        def shape(text: str) -> list[str]:
            return [re.sub(r"[-+]?\d[\d,.]*", "N", line).split()[0] for line in text.splitlines() if line]
        assert shape(printed)[:2] == shape(shown)[:2]
        assert len(printed.splitlines()) > 3


def test_every_output_file_has_a_generator():
    made = {f"{o.name}.out" for o in generate.OUTPUTS}
    assert {p.name for p in (ROOT / "docs" / "outputs").glob("*.out")} <= made
    assert not list((ROOT / "docs").glob("*.out")), "outputs go to docs/outputs/, made by docs/generate.py"


def test_every_public_name_is_in_the_api_reference():
    import remat

    api = (ROOT / "docs" / "api.md").read_text()
    listed = set(re.findall(r"^        - (\w+)$", api, re.MULTILINE)) | set(re.findall(r"^### `remat\.(\w+)`", api, re.MULTILINE))
    listed |= {m.rpartition(".")[2] for m in re.findall(r"^::: (remat\.\w+)$", api, re.MULTILINE)}
    assert sorted(set(remat.__all__) - listed) == []


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT / "src"), "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    html = (tmp_path / "api.html").read_text()
    import remat

    missing = [n for n in remat.__all__ if f'id="remat.{n}"' not in html and f"remat.{n}</code>" not in html]
    assert missing == []
    # the API reference reads as code: examples in code blocks, no Sphinx role, no docstring
    # of a built-in type (int's, str's) under a field
    assert "<blockquote>" not in html and "&gt;&gt;&gt;" in html
    assert not re.search(r":(func|class|meth|attr|data|mod|exc):`", html)
    assert "Convert a string or number" not in html and "integer literal" not in html
    assert _unresolved_links(tmp_path) == []


def _unresolved_links(site: pathlib.Path) -> list[str]:
    """Local links of the built site that land on nothing, on a folder (a bare "Index of"
    listing from file://) or on a missing anchor. 404.html is served by servers only."""
    import html as markup

    pages = {page: set(re.findall(r'\sid="([^"]+)"', page.read_text())) for page in site.rglob("*.html")}
    bad = []
    for page in pages:
        if page.name == "404.html":
            continue
        for link in re.findall(r'(?:href|src)="([^"]+)"', page.read_text()):
            link = markup.unescape(link)
            if re.match(r"^[a-z]+:|^#|^//", link):
                continue
            path, _, anchor = link.partition("#")
            target = (page.parent / path).resolve()
            if not target.is_file() or (anchor and target in pages and anchor not in pages[target]):
                bad.append(f"{page.relative_to(site)} -> {link}")
    return bad


#: the pages for developers: the design notes, and torch's differences (which quote them)
DEVELOPER_PAGES = {"docs/design.md", "docs/torch.md"}


@pytest.mark.parametrize("page", sorted(set(PAGES) - DEVELOPER_PAGES))
def test_user_pages_point_to_no_design_note(page):
    """Design notes ("NOTE [...]" in the code) are listed on the design page; a user page says
    what a rule does, in its own words."""
    text = (ROOT / page).read_text()
    assert re.findall(r"NOTE\s+\[[^\]]+\]", text) == []
