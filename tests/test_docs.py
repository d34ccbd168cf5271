"""README.md and docs/*.md stay true: every relative link and anchor resolves, and every ``moealign`` command
they show (code blocks and inline code) names a subcommand and flags that exist in the CLI's parser."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"(`+)(.+?)\1")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")


# ---------------------------------------------------------------------------------------------------------------
# Markdown structure


def split_markdown(text: str) -> tuple[list[str], list[str]]:
    """(prose lines, code lines): the lines outside and inside fenced code blocks."""
    prose, code, fence = [], [], None
    for line in text.splitlines():
        m = _FENCE.match(line)
        if m:
            if fence is None:
                fence = m.group(1)
                continue
            if m.group(1) == fence:
                fence = None
                continue
        (prose if fence is None else code).append(line)
    return prose, code


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: the rendered text (links -> their text, code and emphasis marks
    dropped), lowercased, every character but letters, digits, '-', '_' and spaces dropped, spaces -> '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text)
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown file; repeated slugs get -1, -2, ... as on GitHub."""
    prose, _ = split_markdown(text)
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = _HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def links(text: str) -> list[str]:
    """Link targets of ``[text](target)`` and ``![alt](target)`` outside code blocks and inline code."""
    prose, _ = split_markdown(text)
    body = _INLINE_CODE.sub("", "\n".join(prose))
    return [m.group(1) for m in _LINK.finditer(body)]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Every relative link of ``path`` whose file, or whose anchor in that file, does not exist."""
    problems = []
    text = path.read_text(encoding="utf-8")
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        where = f"{path.relative_to(root)}: ({target})"
        if not dest.exists():
            problems.append(f"{where}: no file {file_part}")
            continue
        if anchor:
            if dest.is_dir() or dest.suffix.lower() != ".md":
                problems.append(f"{where}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(dest.read_text(encoding="utf-8")):
                problems.append(f"{where}: no heading #{anchor} in {dest.relative_to(root)}")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# moealign commands shown in the docs


def shown_commands(text: str) -> list[str]:
    """The text of every ``moealign ...`` command: code-block lines (backslash continuations joined) and inline
    code spans that start with ``moealign ``. Comments after `` #`` are dropped."""
    prose, code = split_markdown(text)
    out = []
    joined, pending = [], ""
    for line in code:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        joined.append(pending + line)
        pending = ""
    if pending:
        joined.append(pending)
    for line in joined:
        line = re.sub(r"\s#.*$", "", line).strip()
        line = re.sub(r"^\$\s+", "", line)
        if line.startswith("moealign "):
            out.append(line)
    for line in prose:
        for m in _INLINE_CODE.finditer(line):
            span = m.group(2).strip()
            if span.startswith("moealign "):
                out.append(span)
    return out


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def command_problems(command: str, parser: argparse.ArgumentParser) -> list[str]:
    """What in one shown command the parser does not have: an unknown subcommand (walking nested subparsers,
    e.g. ``record inspect``) or an unknown flag of the subcommand reached."""
    try:
        tokens = shlex.split(command)
    except ValueError:
        tokens = command.split()
    assert tokens and tokens[0] == "moealign", command
    path = ["moealign"]
    i = 1
    while i < len(tokens):
        subs = _subparsers(parser)
        if not subs or tokens[i].startswith("-"):
            break
        if tokens[i] not in subs:
            return [f"`{command}`: no subcommand {' '.join(path[1:] + [tokens[i]])!r}"]
        parser = subs[tokens[i]]
        path.append(tokens[i])
        i += 1
    known = parser._option_string_actions
    problems = []
    for tok in tokens[i:]:
        if not tok.startswith("-") or tok in ("-", "--") or re.match(r"^-\d", tok) or tok.startswith("-..."):
            continue
        flag = tok.split("=", 1)[0]
        if flag not in known:
            problems.append(f"`{command}`: {' '.join(path)} has no flag {flag}")
    return problems


def stale_commands(path: Path, parser: argparse.ArgumentParser) -> list[str]:
    problems = []
    for command in shown_commands(path.read_text(encoding="utf-8")):
        problems += [f"{path.name}: {p}" for p in command_problems(command, parser)]
    return problems


@pytest.fixture(scope="module")
def parser():
    from moealign.cli import build_parser

    return build_parser()


# ---------------------------------------------------------------------------------------------------------------
# the checks


def test_docs_exist_and_readme_links_every_page():
    assert (ROOT / "docs").is_dir()
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve() for t in links(readme.read_text(encoding="utf-8"))
              if t.partition("#")[0]}
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert len(pages) >= 10
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_and_anchors_resolve(path):
    assert not broken_links(path), "\n".join(broken_links(path))


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_shown_commands_exist_in_the_parser(path, parser):
    problems = stale_commands(path, parser)
    assert not problems, "\n".join(problems)


def test_the_docs_show_commands_at_all():
    # the command check must have something to check: the README shows the main job and rl-check
    commands = [c for p in DOC_FILES for c in shown_commands(p.read_text(encoding="utf-8"))]
    assert any(c.startswith("moealign mismatch") for c in commands)
    assert any(c.startswith("moealign rl-check") for c in commands)
    assert any(c.startswith("moealign record inspect") for c in commands)
    assert any(c.startswith("moealign record convert") for c in commands)
    assert len(commands) >= 20


# ---------------------------------------------------------------------------------------------------------------
# the checkers themselves (negative controls)


def test_slug_rule():
    assert github_slug("RL through refits: `moealign rl-check`") == "rl-through-refits-moealign-rl-check"
    assert github_slug("Why do they disagree? `moealign mismatch --diagnose` / `--report DIR`") == \
        "why-do-they-disagree-moealign-mismatch---diagnose----report-dir"
    assert github_slug("Q1. Does the reload sequence exist in 0.33? Yes, unchanged.") == \
        "q1-does-the-reload-sequence-exist-in-033-yes-unchanged"
    assert github_slug("Keep **bold** and snake_case [a link](x.md)") == "keep-bold-and-snake_case-a-link"
    text = "# Speed\n\n## Speed\n\n```\n# not a heading\n```\n\n## Speed\n"
    assert anchors(text) == {"speed", "speed-1", "speed-2"}
    assert "not-a-heading" not in anchors(text)


def test_link_checker_reports_broken_links(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("# A page\n\n## Twice\n\n## Twice\n", encoding="utf-8")
    readme = tmp_path / "README.md"
    readme.write_text(
        "# Top\n\n"
        "[ok](docs/page.md) [ok anchor](docs/page.md#a-page) [ok dup](docs/page.md#twice-1) [self](#top)\n"
        "[web](https://example.com/nowhere.md) `[in code](docs/nowhere.md)`\n"
        "[no file](docs/nowhere.md) [no anchor](docs/page.md#no-such-heading) [no self](#missing)\n"
        "[third dup](docs/page.md#twice-2) ![no image](docs/img/none.png)\n"
        "```\n[in a block](docs/also-nowhere.md)\n```\n",
        encoding="utf-8",
    )
    problems = broken_links(readme, root=tmp_path)
    assert len(problems) == 5, problems
    joined = "\n".join(problems)
    for target in ("docs/nowhere.md)", "#no-such-heading", "#missing", "#twice-2", "none.png"):
        assert target in joined
    assert "also-nowhere" not in joined and "example.com" not in joined


def test_command_checker_reports_stale_commands(parser, tmp_path):
    assert command_problems("moealign mismatch --json r.json --fail-above kl_k3=1e-3 -q", parser) == []
    assert command_problems("moealign record inspect r.safetensors --model DIR --json x.json", parser) == []
    assert command_problems("moealign record convert --to verl r.safetensors -o batch.pt", parser) == []
    assert command_problems("moealign rl-check --staleness 2 --lr 0", parser) == []
    assert command_problems("moealign --version", parser) == []
    assert command_problems("moealign mismatch --no-such-flag 3", parser) == \
        ["`moealign mismatch --no-such-flag 3`: moealign mismatch has no flag --no-such-flag"]
    assert command_problems("moealign rl-check --sweep", parser)          # a flag of another subcommand
    assert command_problems("moealign record inspekt r.safetensors", parser)
    assert command_problems("moealign record inspect r.safetensors --to verl", parser)   # convert's flag
    assert command_problems("moealign mismatchh", parser)
    page = tmp_path / "page.md"
    page.write_text(
        "Run `moealign mismatch --made-up-flag`.\n\n```bash\nmoealign tp-check --world-sizes 1,2 \\\n"
        "    --also-made-up   # a comment --ignored-flag\npytest --made-up-pytest-flag\n"
        "python tools/bench_replay.py --backward\n```\n",
        encoding="utf-8",
    )
    problems = stale_commands(page, parser)
    assert len(problems) == 2, problems
    assert "--made-up-flag" in problems[1] or "--made-up-flag" in problems[0]
    assert any("--also-made-up" in p for p in problems)
