"""The README's flag tables are generated from pretrain_hdp.py's parser and up to date."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_readme_flag_tables_are_current():
    spec = importlib.util.spec_from_file_location("gen", REPO / "scripts" / "gen_flags_doc.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    readme = (REPO / "README.md").read_text()
    assert gen.render(readme) == readme, "run: .venv/bin/python scripts/gen_flags_doc.py"
    assert "`--exit-interval`" in readme and "`--hdp-capacity`" in readme
