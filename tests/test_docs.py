"""The documentation a user reads: a short README that says what kvsnap does, a CLI reference that
is what the parsers print, and no page, comment or docstring that describes how the project was
built instead of what it does."""

from __future__ import annotations

import re
from pathlib import Path

from kvsnap.cli.reference import page
from tests.conftest import ROOT

# Words that say how the product was built rather than what it does: a numbered working period
# or ticket, a rented machine, the build machine, an attempt that was undone. Spelled in pieces so
# that this file passes its own scan.
PERIOD, TICKET, RENTAL = "sess" + "ion", "iss" + "ue", "lea" + "se"
BUILDER, UNDONE = "CI " + "machine", "tried " + "and"
PROCESS = re.compile(
    rf"\b{PERIOD}s? \d+|\b{TICKET}s? \d+|\b{RENTAL}s?\b|\b{BUILDER}\b"
    rf"|\b{UNDONE} (?:reverted|not kept)\b",
    re.IGNORECASE,
)
SCANNED = ("kvformat", "capture", "analysis", "kvsnap", "spec", "tests", "benchmarks", "docs")
SUFFIXES = {".py", ".md", ".c", ".js", ".ksy", ".toml", ".yml", ".txt"}


def product_files() -> list[Path]:
    files = [
        ROOT / name for name in ("README.md", "CHANGELOG.md", "Makefile", "pyproject.toml", "mkdocs.yml")
    ]
    for folder in SCANNED:
        for path in (ROOT / folder).rglob("*"):
            parts = set(path.relative_to(ROOT).parts)
            if path.suffix in SUFFIXES and path.is_file() and not parts & {"node_modules", "__pycache__"}:
                files.append(path)
    return files


def test_no_process_words_in_the_product() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}"
        for path in product_files()
        for number, line in enumerate(path.read_text("utf-8", errors="replace").splitlines(), 1)
        if PROCESS.search(line)
    ]
    assert not found, "\n".join(found)


def test_the_scan_catches_process_words() -> None:
    for text in (
        f"measured in {PERIOD} 36",
        f"see {TICKET} 65",
        f"on that {RENTAL}",
        f"the {BUILDER}",
        f"{UNDONE} reverted",
    ):
        assert PROCESS.search(text), text
    for text in ("released once added", "a long session log", "session.mvlog", "issues a warning"):
        assert not PROCESS.search(text), text


def test_the_readme_is_short_and_says_what_kvsnap_does() -> None:
    text = (ROOT / "README.md").read_text("utf-8")
    assert len(text.splitlines()) <= 200
    first = text.split("\n\n")[1]  # the paragraph under the title
    assert "KV cache" in first and "mlx-lm" in first
    assert "make demo" in text and "make test" in text


def test_the_cli_reference_is_what_the_parsers_print() -> None:
    committed = (ROOT / "docs" / "cli.md").read_text("utf-8")
    assert committed == page(), "docs/cli.md is stale: python -m kvsnap.cli.reference > docs/cli.md"
    for command in ("capture", "stats", "simulate", "export", "attention", "plot", "info", "verify"):
        assert f"## `kvsnap {command}`" in committed


def test_every_guide_page_is_in_the_site() -> None:
    config = (ROOT / "mkdocs.yml").read_text("utf-8")
    for page_file in (ROOT / "docs").glob("*.md"):
        assert page_file.name in config, f"{page_file.name} is not in mkdocs.yml's nav"


def test_the_api_page_reads_on_github_and_the_site_renders_each_entry() -> None:
    """docs/api.md holds no raw ``:::`` directive (GitHub shows those as text); each entry point
    is an ``<!-- api: NAME -->`` marker, which the site's hook turns into mkdocstrings' directive,
    and which names something that imports."""
    import importlib
    import importlib.util

    text = (ROOT / "docs" / "api.md").read_text("utf-8")
    assert not [line for line in text.splitlines() if line.startswith(":::")]
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    assert spec is not None and spec.loader is not None
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page = type("Page", (), {"file": type("File", (), {"src_uri": "api.md"})()})()
    rendered = hooks.on_page_markdown(text, page)
    names = [line[4:] for line in rendered.splitlines() if line.startswith("::: ")]
    assert len(names) == text.count("<!-- api: ") >= 15
    for name in names:  # the site reads the stages' folders; installed, they are kvsnap's
        installed = f"kvsnap.{name}" if name.startswith(("capture.", "analysis.")) else name
        module, _, attribute = installed.rpartition(".")
        try:
            found = importlib.import_module(installed)
        except ImportError:
            found = getattr(importlib.import_module(module), attribute)
        assert found is not None, name
