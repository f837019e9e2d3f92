"""What `pip install` would do where the GPUs are: no PyPI impostors, no torch replacement."""

from __future__ import annotations

import tomllib
from packaging.requirements import Requirement
from packaging.version import Version

from tests.unit.scripts_loader import REPO

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _requirements():
    project = PYPROJECT["project"]
    yield from project["dependencies"]
    for extra in project["optional-dependencies"].values():
        yield from extra


def test_no_extra_pulls_pypis_apex_or_an_unpinned_transformer_engine():
    names = {Requirement(r).name.lower().replace("_", "-"): Requirement(r) for r in _requirements()}
    # PyPI's "apex" is an unrelated 2013 web toolkit; NVIDIA Apex is never on the index.
    assert "apex" not in names
    for name in ("transformer-engine", "transformer-engine-torch", "flash-attn"):
        if name in names:
            assert names[name].specifier, f"{name} is unpinned"


def test_an_ngc_containers_torch_build_satisfies_the_torch_requirement():
    """NGC ships pre-release local builds; pip keeps an installed one if it satisfies the
    range with pre-releases allowed (as pip treats installed distributions)."""
    torch_req = next(Requirement(r) for r in _requirements() if Requirement(r).name == "torch")
    for ngc in ("2.7.0a0+7c8ec84dab.nv25.03", "2.8.0a0+5228986c39.nv25.06", "2.10.0a0+nv25.11"):
        assert torch_req.specifier.contains(Version(ngc), prereleases=True), ngc
    assert torch_req.specifier.contains(Version("2.13.0"))
    # A 2.6 pre-release is below 2.6: with docs/gpu.md's constraints file pip then stops with
    # a conflict instead of replacing the container's torch.
    assert not torch_req.specifier.contains(Version("2.6.0a0+ecf3bae40a"), prereleases=True)


def test_the_declared_lowest_torch_is_what_megatron_core_needs_too():
    from importlib import metadata

    ours = next(Requirement(r) for r in _requirements() if Requirement(r).name == "torch")
    theirs = [
        Requirement(r)
        for r in metadata.requires("megatron-core") or []
        if Requirement(r).name == "torch" and not Requirement(r).marker
    ]
    lowest = min(Version(s.version) for s in ours.specifier if s.operator == ">=")
    for req in theirs:
        assert req.specifier.contains(lowest) or all(
            Version(s.version) <= lowest for s in req.specifier if s.operator == ">="
        )
