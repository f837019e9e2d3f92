"""The bytes each shard file of a distributed checkpoint must hold (pure: stdlib only).

torch's distributed checkpoint (under Megatron's `dist_checkpointing`) writes its tensors
into `*.distcp` files and, last, an index `.metadata`: a pickle that names, for every
stored item, its file, offset and length. A shard file cut short (a copy or a crash that
lost its end) is found by comparing the index with the files' sizes, before torch is
imported: the index is read with an unpickler that builds no torch object, only
placeholders that keep their arguments and state.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

#: torch's name for the index of a distributed checkpoint folder.
INDEX = ".metadata"


class _Placeholder:
    """Any object of the index: the arguments it was made with and its pickled state."""

    def __new__(cls, *args, **kwargs):
        obj = super().__new__(cls)
        obj.args, obj.state = args, {}
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.state = state if isinstance(state, dict) else {}


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles the index with a placeholder class for every global it names."""

    def __init__(self, data: bytes):
        super().__init__(io.BytesIO(data))
        self._classes: dict[tuple[str, str], type] = {}

    def find_class(self, module: str, name: str) -> type:
        key = (module, name)
        if key not in self._classes:
            self._classes[key] = type(name, (_Placeholder,), {})
        return self._classes[key]


def _storage_infos(root):
    """Every `_StorageInfo` placeholder reachable from `root`."""
    stack, seen = [root], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, _Placeholder):
            if type(obj).__name__ == "_StorageInfo":
                yield obj.state
            stack.extend(obj.args)
            stack.extend(obj.state.values())
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set):
            stack.extend(obj)


def index_problem(folder: str | Path) -> str | None:
    """Why the index of a distributed checkpoint `folder` cannot be used, or None.

    For a folder that is known to be in the distributed format (it has `metadata.json`).
    """
    index = Path(folder) / INDEX
    if not index.is_file():
        return f"{INDEX} (the index of its shards) is missing"
    try:
        _IndexUnpickler(index.read_bytes()).load()
    except Exception as err:  # noqa: BLE001 - any failure to read it is damage
        return f"{INDEX} (the index of its shards) cannot be read ({type(err).__name__})"
    return None


def required_sizes(folder: str | Path) -> dict[str, int] | None:
    """The least size in bytes of each shard file the index of `folder` names.

    None where `folder` holds no index or the index cannot be read this way (then nothing
    is known, and nothing is refused).
    """
    index = Path(folder) / INDEX
    if not index.is_file():
        return None
    try:
        root = _IndexUnpickler(index.read_bytes()).load()
    except Exception:  # noqa: BLE001 - an index this reader does not follow proves nothing
        return None
    sizes: dict[str, int] = {}
    for info in _storage_infos(root):
        path, offset, length = (info.get(k) for k in ("relative_path", "offset", "length"))
        if isinstance(path, str) and isinstance(offset, int) and isinstance(length, int):
            sizes[path] = max(sizes.get(path, 0), offset + length)
    return sizes or None


def short_shards(folder: str | Path) -> list[tuple[str, int, int | None]]:
    """(file, bytes needed, bytes present or None if missing) for each shard cut short."""
    needed = required_sizes(folder) or {}
    short = []
    for name, size in sorted(needed.items()):
        path = Path(folder) / name
        have = path.stat().st_size if path.is_file() else None
        if have is None or have < size:
            short.append((name, size, have))
    return short
