"""The documentation: flag tables generated from pretrain_hdp.py's parser and up to date,
its examples valid, its pages short, and every relative link and anchor alive."""

import re

import pytest

from tests.unit.scripts_loader import REPO, load_script

README_MAX_LINES = 300
PAGE_MAX_LINES = 420
PAGES = sorted((REPO / "docs").glob("*.md"))


def test_flag_tables_are_current():
    gen = load_script("scripts/gen_flags_doc.py", "gen")
    assert gen.PAGE == REPO / "docs" / "flags.md"
    page = gen.PAGE.read_text()
    assert gen.render(page) == page, "run: .venv/bin/python scripts/gen_flags_doc.py"
    assert "`--exit-interval`" in page and "`--hdp-capacity`" in page


def test_a_stale_flag_page_is_caught():
    """render() rewrites whatever stands between the markers, so a stale page differs."""
    gen = load_script("scripts/gen_flags_doc.py", "gen")
    page = gen.PAGE.read_text()
    stale = page.replace("| `--hdp-capacity` |", "| `--hdp-capacity-old` |")
    assert stale != page and gen.render(stale) == page


def test_the_data_spec_example_is_a_valid_spec():
    import yaml  # the dev extra has PyYAML (Ray needs it too)

    from megatron_hdp.data.spec import parse_spec

    page = (REPO / "docs" / "data.md").read_text()
    section = page[page.index("## Data spec (`--hdp-data-spec`)") :]
    block = section[section.index("```yaml\n") + len("```yaml\n") : section.index("```\n", 10)]
    spec = parse_spec(yaml.safe_load(block), base="/data")
    assert [s.kind for s in spec.sources] == ["indexed", "jsonl", "jsonl", "builtin"]
    assert [s.tokenize for s in spec.sources][1:3] == ["on_open", "on_read"]
    assert spec.streams[:2] == ("code/short", "code/long") and len(spec.streams) == 8
    spec.check_covers(5000)


def test_the_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move a topic to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_page_is_short(page):
    lines = page.read_text().count("\n")
    assert lines <= PAGE_MAX_LINES, f"{page.name} has {lines} lines: split it by topic"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a Markdown text (repeats get -1, -2, ... as on GitHub)."""
    found, seen = set(), {}
    fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        m = re.match(r"#{1,6} (.+)", line)
        if m and not fence:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_slug_matches_githubs_anchors():
    assert slug("Tensor-parallel replicas (`--tensor-model-parallel-size`)") == (
        "tensor-parallel-replicas---tensor-model-parallel-size"
    )
    assert slug("Pipelines: the lock-step rule and PP-Balance") == (
        "pipelines-the-lock-step-rule-and-pp-balance"
    )
    assert anchors("# A\n## A\n```\n# B\n```\n") == {"a", "a-1"}


def relative_links(text: str) -> list[str]:
    """Targets of the inline links and images that are not URLs, outside code blocks."""
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize(
    "doc", [REPO / "README.md", *PAGES], ids=lambda p: str(p.relative_to(REPO))
)
def test_every_relative_link_and_anchor_exists(doc):
    text = doc.read_text()
    dead = []
    for target in relative_links(text):
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            dead.append(f"{target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            dead.append(f"{target} (no heading with that anchor)")
    assert not dead, f"{doc.relative_to(REPO)}: dead links: {dead}"


def test_the_link_check_sees_dead_links(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Here (`x`)\n")
    text = "[ok](a.md#here-x) [bad](b.md) `[code](c.md)` [anchor](a.md#gone) [web](https://x.y)"
    assert relative_links(text) == ["a.md#here-x", "b.md", "a.md#gone"]
    assert "here-x" in anchors((tmp_path / "a.md").read_text())
    assert "gone" not in anchors((tmp_path / "a.md").read_text())
