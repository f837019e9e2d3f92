"""The layers of architecture.md hold: Megatron-Core behind the host layer's doors,
torch.distributed in the comm and host layers, no torch at all in the pure layer.

Every import statement of the library is read (function-level ones included), so a new
import where a layer forbids it fails here, naming the file and the line.
"""

from __future__ import annotations

import ast

from tests.unit.scripts_loader import REPO

PACKAGE = REPO / "megatron_hdp"
#: The host layer: Megatron-Core glue, and Megatron-LM's training loop glue (`megatron_lm/`).
HOST = ("megatron/", "megatron_lm/")
#: Where torch.distributed may be imported: the comm layer, the host layer, the launcher,
#: and the ring attention function (ops), which builds its ring's communicator.
DISTRIBUTED = ("distributed/", "megatron/", "megatron_lm/", "launch.py", "attention/ring.py")
#: The pure layer: stdlib and numpy only (the planner, the simulator, the advisor).
PURE = (
    "scheduler/",
    "sim/",
    "advise/",
    "sharding.py",
    "data/sampler.py",
    "data/spec.py",
    "offload/host_budget.py",
    "checkpoint_digests.py",
)


def imports(source: str) -> list[tuple[int, str]]:
    """`(line, module)` of every absolute import in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def violations(relative: str, source: str) -> list[str]:
    """What `source`, at `relative` inside the package, imports against the layer rules."""
    bad = []
    for line, module in imports(source):
        top = module.split(".")[0]
        where = f"megatron_hdp/{relative}:{line} imports {module}"
        if top == "megatron" and not relative.startswith(HOST):
            bad.append(f"{where}: Megatron only in the host layer (megatron/, megatron_lm/)")
        if module.startswith("torch.distributed") and not relative.startswith(DISTRIBUTED):
            bad.append(f"{where}: torch.distributed only in the comm and host layers")
        if top == "torch" and relative.startswith(PURE):
            bad.append(f"{where}: the pure layer imports no torch")
    return bad


def test_every_module_keeps_to_its_layer():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        found += violations(relative, path.read_text())
    assert not found, "\n".join(found)


def test_the_check_catches_each_kind_of_violation():
    assert violations("data/indexed.py", "from megatron.core.datasets import x\n")
    assert violations("sim/simulate.py", "def f():\n    import megatron.core\n")
    assert violations("data/batching.py", "import torch.distributed as dist\n")
    assert violations("scheduler/plan.py", "import torch\n")
    assert not violations("megatron/step.py", "import torch.distributed\nimport megatron.core\n")
    assert not violations("attention/ring.py", "import torch.distributed as dist\n")
