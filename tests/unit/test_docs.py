"""The README's flag tables are generated from pretrain_hdp.py's parser and up to date."""

from tests.unit.scripts_loader import REPO, load_script


def test_readme_flag_tables_are_current():
    gen = load_script("scripts/gen_flags_doc.py", "gen")
    readme = (REPO / "README.md").read_text()
    assert gen.render(readme) == readme, "run: .venv/bin/python scripts/gen_flags_doc.py"
    assert "`--exit-interval`" in readme and "`--hdp-capacity`" in readme


def test_the_readme_data_spec_example_is_a_valid_spec():
    import yaml  # the dev extra has PyYAML (Ray needs it too)

    from megatron_hdp.data.spec import parse_spec

    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("### Data spec (`--hdp-data-spec`)") :]
    block = section[section.index("```yaml\n") + len("```yaml\n") : section.index("```\n", 10)]
    spec = parse_spec(yaml.safe_load(block), base="/data")
    assert [s.kind for s in spec.sources] == ["indexed", "jsonl", "builtin"]
    assert spec.streams[:2] == ("code/short", "code/long") and len(spec.streams) == 6
    spec.check_covers(5000)
