"""Rewrite the flag tables of docs/flags.md from pretrain_hdp.py's parser.

.venv/bin/python scripts/gen_flags_doc.py          # rewrite docs/flags.md in place
.venv/bin/python scripts/gen_flags_doc.py --check  # exit 1 if docs/flags.md is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_hdp.megatron.arguments import build_parser  # noqa: E402

START, END = "<!-- flags:start -->", "<!-- flags:end -->"
#: The page that holds the generated tables, between START and END.
PAGE = REPO / "docs" / "flags.md"


def flag_tables() -> str:
    """Markdown tables of every argument group of the parser."""
    parser = build_parser()
    out = []
    for group in parser._action_groups:
        if group.title in ("positional arguments", "options"):
            continue
        out += [f"\n**{group.title}**\n", "| flag | default | meaning |", "|---|---|---|"]
        for action in group._group_actions:
            flags = ", ".join(f"`{o}`" for o in action.option_strings)
            default = action.default
            if action.required:
                default = "required"
            elif default in (None, False):
                default = ""
            else:
                default = f"`{default}`"
            meaning = (action.help or "").replace("%%", "%").replace("|", "\\|")
            out.append(f"| {flags} | {default} | {meaning} |")
    return "\n".join(out) + "\n"


def render(page: str) -> str:
    """The page's text with the block between the markers regenerated."""
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{flag_tables()}{END}{tail}"


def main() -> int:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--check", action="store_true", help="only check, do not write")
    check = args.parse_args().check
    path = PAGE
    current = path.read_text()
    wanted = render(current)
    if check:
        if wanted != current:
            print("docs/flags.md flag tables are stale: run scripts/gen_flags_doc.py")
            return 1
        return 0
    path.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
