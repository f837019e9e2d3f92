"""Apply megatron_hdp's patch to a Megatron-LM checkout: `pretrain_gpt.py --hdp` then trains
with Hybrid Data Parallelism (without `--hdp` the job stays stock).

    python scripts/apply_megatron_patch.py /path/to/Megatron-LM [--tag core_v0.16.1] [--check]

The tag is read from the checkout (`git describe --tags --exact-match`, else
`megatron/core/package_info.py`) unless `--tag` names it. An unknown tag is refused by name,
with the tags there are patches for. `--check` only reports whether the patch applies.
Exit status: 0 applied (or already applied), 2 refused.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

PATCHES = Path(__file__).resolve().parent.parent / "patches"


def known_tags() -> list[str]:
    """The Megatron-LM tags there is a patch for (one folder each under patches/)."""
    return sorted(p.name for p in PATCHES.iterdir() if p.is_dir() and list(p.glob("*.patch")))


def detect_tag(checkout: Path) -> str | None:
    """The checkout's release tag, from git or from megatron/core/package_info.py."""
    try:
        out = subprocess.run(
            ["git", "-C", str(checkout), "describe", "--tags", "--exact-match"],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        out = None
    if out is not None and out.returncode == 0 and out.stdout.strip():
        return out.stdout.strip()
    info = checkout / "megatron" / "core" / "package_info.py"
    if info.is_file():
        text = info.read_text()
        parts = [re.search(rf"^{k}\s*=\s*(\d+)", text, re.M) for k in ("MAJOR", "MINOR", "PATCH")]
        if all(parts):
            return "core_v" + ".".join(p.group(1) for p in parts)
    return None


def _git_apply(checkout: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    # Inside another repository, git apply takes paths from that repository's root and skips
    # the rest; the ceiling keeps it from looking above the checkout.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(checkout.resolve().parent))
    return subprocess.run(
        ["git", "apply", *flags, str(patch.resolve())],
        cwd=checkout,
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )


def apply(checkout: Path, tag: str | None = None, *, check: bool = False) -> str:
    """Apply (or with `check`, test) the patch for `tag`; returns what was done.

    Raises ValueError for an unknown tag, a checkout without `pretrain_gpt.py`, or a patch
    that does not apply (the file was edited).
    """
    if not (checkout / "pretrain_gpt.py").is_file():
        raise ValueError(f"{checkout}: no pretrain_gpt.py (not a Megatron-LM checkout)")
    tags = known_tags()
    if tag is None:
        tag = detect_tag(checkout)
        if tag is None:
            raise ValueError(f"{checkout}: cannot tell its Megatron-LM tag; pass --tag ({tags})")
    if tag not in tags:
        raise ValueError(f"no patch for Megatron-LM tag {tag!r}; there are patches for {tags}")
    done = []
    for patch in sorted((PATCHES / tag).glob("*.patch")):
        if _git_apply(checkout, patch, "--check").returncode != 0:
            if _git_apply(checkout, patch, "--check", "--reverse").returncode == 0:
                done.append(f"{patch.name} (already applied)")
                continue
            detail = _git_apply(checkout, patch, "--check").stderr.strip()
            raise ValueError(f"{patch.name} does not apply to {checkout}: {detail}")
        if not check:
            result = _git_apply(checkout, patch)
            if result.returncode != 0:
                raise ValueError(f"{patch.name}: {result.stderr.strip()}")
        done.append(f"{patch.name} ({'applies' if check else 'applied'})")
    return f"{tag}: {', '.join(done)}"


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="the Megatron-LM checkout to patch")
    parser.add_argument("--tag", default=None, help="its tag, e.g. core_v0.16.1 (default: read)")
    parser.add_argument("--check", action="store_true", help="only check that it applies")
    args = parser.parse_args(argv)
    try:
        print(apply(args.checkout, args.tag, check=args.check))
    except ValueError as err:
        print(f"apply_megatron_patch.py: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
