"""The README and docs/ as a reader uses them: every relative link resolves, and every flag of an
`engine ...` command in a shell block exists in that subcommand's --help."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_BLOCK = re.compile(r"```(?:bash|sh|console)\n(.*?)```", re.S)
LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _engine_commands(page: Path) -> list[str]:
    """The `engine <subcommand> ...` lines of a page's shell blocks, continuations joined."""
    commands = []
    for block in SHELL_BLOCK.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith("engine "):
                commands.append(line)
    return commands


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) < 200
    assert len(PAGES) > 8


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{page.name} links to {target}, which does not exist"


@pytest.fixture(scope="module")
def help_texts() -> dict[str, str]:
    texts = {}
    for sub in ("generate", "serve", "proxy", "disagg", "ray-serve", "secret", "status"):
        texts[sub] = subprocess.run([sys.executable, "-m", "entrypoints.cli", sub, "--help"], cwd=ROOT,
                                    capture_output=True, text=True, check=True, timeout=120).stdout
    return texts


def test_every_documented_flag_exists(help_texts):
    commands = [(page.name, c) for page in PAGES for c in _engine_commands(page)]
    assert len(commands) > 15
    for page, command in commands:
        sub = command.split()[1]
        assert sub in help_texts, f"{page}: `{command}` names no subcommand"
        own, _, passed_on = command.partition(" -- ")  # engine ray-serve hands these to engine serve
        for text, of in ((own, sub), (passed_on, "serve")):
            for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text):
                assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", help_texts[of]), \
                    f"{page}: `{command}`: {flag} is not an option of `engine {of}`"
