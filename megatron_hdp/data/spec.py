"""The declarative data spec: sources, weights, length buckets and a schedule (pure layer).

One JSON or YAML file says what a job trains on; the in-process loader and the Ray data
service both read it (`--hdp-data-spec FILE`)::

    {
      "sources": [
        {"name": "code", "path": "data/code_text", "weight": 0.7, "loaders": 2},
        {"name": "docs", "jsonl": "data/docs.jsonl", "json_key": "text", "weight": 0.3},
        {"name": "stdlib", "builtin": "stdlib", "weight": 0.0}
      ],
      "length_buckets": [{"name": "short", "max_tokens": 2048}, {"name": "long"}],
      "schedule": [
        {"until_step": 100, "weights": {"code/short": 0.6, "docs": 0.4}},
        {"until_step": 1000, "weights": {"code": 0.5, "docs": 0.3, "stdlib": 0.2}}
      ]
    }

- A source is an indexed dataset (`path`: the prefix of a `.bin`/`.idx` pair), raw JSONL
  text (`jsonl`: one file or a list, `json_key`, default "text"; `tokenize`: "on_open",
  the default, tokenizes it all when opened, "on_read" keeps a cached lengths index and
  tokenizes each document when it is read), the embedded corpus (`builtin: "stdlib"`), or
  deterministic synthetic documents with a declared cost per token read, for tests and
  benchmarks (`synthetic: {documents, min_tokens, max_tokens, seed, vocab,
  cpu_us_per_token, latency_us_per_token}`). `loaders` is how many source-loader actors
  the Ray service runs for it: a fixed number (1 to 64, default 1), or `{min, max}` to
  let the planner scale it by measured cost (`data/service/autoscale.py`), starting at
  `min`; each loader holds a contiguous, token-balanced range of the documents. `cpus`
  is what each of its loaders asks Ray for (default 0.25: Ray places four on a core; say
  1 for a CPU-bound source). The in-process loader ignores both.
- `data_plane` (optional) bounds and tunes the Ray service's loaders as a whole:
  `{cpus, interval_s, scale_up_busy, scale_down_busy, scale_up_wait, patience,
  cooldown}` (`PlaneSpec`): `cpus` is the CPU budget of every loader and shadow of the
  job together (default: no budget beyond the cluster's own CPUs).
- `length_buckets` split every source's training sequences by length into streams named
  `source/bucket`: a sequence goes to the first bucket whose `max_tokens` it fits (the last
  bucket has no `max_tokens`). Without buckets each source is one stream.
- Weights are token shares. A weight may name a source (shared by its buckets in
  proportion to their tokens) or one stream `source/bucket`. `schedule` is a list of
  phases, each with the weights of steps `(previous until_step, until_step]`; it must
  cover training (`until_step >= --train-iters`). Without a schedule the sources' `weight`s
  hold for the whole run. Weights may be 0 (that stream is paused), never negative or NaN,
  and not all 0 in a phase.

`load_spec(path)` parses and checks a file; `DataSpec.stream_weights` turns a phase's
weights into one weight per stream once the streams' token counts are known.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

#: Built-in sources a spec may name with `builtin`.
BUILTIN_SOURCES = ("stdlib",)

_SOURCE_KEYS = {
    "name", "path", "jsonl", "json_key", "tokenize", "builtin", "synthetic", "weight", "loaders",
    "cpus",
}  # fmt: skip
#: When a JSONL source is tokenized: all of it when opened, or each document when read.
TOKENIZE_MODES = ("on_open", "on_read")
#: A synthetic source's fields and defaults (`cpu_us_per_token`, `latency_us_per_token`:
#: the cost of each token read; they do not change the tokens).
SYNTHETIC_DEFAULTS = {
    "documents": 100,
    "min_tokens": 16,
    "max_tokens": 1024,
    "seed": 0,
    "vocab": 257,
    "cpu_us_per_token": 0.0,
    "latency_us_per_token": 0.0,
}
#: The synthetic fields that are costs, not content.
SYNTHETIC_COSTS = ("cpu_us_per_token", "latency_us_per_token")
_TOP_KEYS = {"sources", "length_buckets", "schedule", "data_plane"}

#: Source-loader actors a source may ask for: each is a Ray actor holding the source open.
MAX_LOADERS = 64
#: CPUs each source loader asks Ray for unless its source says (`cpus`).
DEFAULT_LOADER_CPUS = 0.25

#: Exponent forms YAML 1.1 (PyYAML) reads as text: `1e-3` (no dot), `1.5e3` (no sign).
_EXPONENT_FORM = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")


@dataclass(frozen=True)
class SourceSpec:
    """One source of documents (exactly one of `path`, `jsonl`, `builtin`, `synthetic` is set)."""

    name: str
    weight: float
    path: str | None = None
    jsonl: tuple[str, ...] = ()
    json_key: str = "text"
    builtin: str | None = None
    loaders: int = 1
    tokenize: str = "on_open"
    synthetic: tuple[tuple[str, float], ...] = ()
    max_loaders: int | None = None
    cpus: float = DEFAULT_LOADER_CPUS

    @property
    def loader_range(self) -> tuple[int, int]:
        """`(min, max)` loaders: `loaders` is the minimum (and the start); equal when fixed."""
        return self.loaders, self.max_loaders if self.max_loaders is not None else self.loaders

    @property
    def holds_tokens(self) -> bool:
        """Whether a loader holds its part's tokens (JSONL tokenized when opened).

        Such a loader serves only the documents it opened; every other reader holds
        offsets or nothing, so any of the source's loaders can serve any document.
        """
        return self.kind == "jsonl" and self.tokenize == "on_open"

    @property
    def kind(self) -> str:
        """The kind of source: indexed, jsonl, builtin or synthetic."""
        if self.builtin is not None:
            return "builtin"
        if self.synthetic:
            return "synthetic"
        return "indexed" if self.path else "jsonl"

    @property
    def synthetic_params(self) -> dict:
        """A synthetic source's fields (defaults filled in)."""
        return dict(self.synthetic)


@dataclass(frozen=True)
class Bucket:
    """A length bucket: sequences of at most `max_tokens` inputs (None: any length)."""

    name: str
    max_tokens: int | None


@dataclass(frozen=True)
class Phase:
    """The weights of steps `(previous phase's until_step, until_step]`."""

    until_step: int
    weights: Mapping[str, float]


@dataclass(frozen=True)
class PlaneSpec:
    """The Ray data plane's budget and scaling knobs (`data_plane` in the spec).

    `cpus`: CPUs all loaders and shadows of the job may ask Ray for together (None: the
    cluster's). The planner measures every `interval_s` seconds; a source whose loaders
    were busy at least `scale_up_busy` of the time, or to which the ranks' data wait
    was at least `scale_up_wait` of their time, for `patience` measurements in a row
    gets one more loader; one whose loaders were busy under `scale_down_busy` (and
    would stay under `scale_up_busy` with one fewer) for `patience` measurements with
    no such wait gets one fewer. After a change a source is left alone for `cooldown`
    measurements (`data/service/autoscale.py`).
    """

    cpus: float | None = None
    interval_s: float = 1.0
    scale_up_busy: float = 0.8
    scale_down_busy: float = 0.3
    scale_up_wait: float = 0.05
    patience: int = 2
    cooldown: int = 2


@dataclass(frozen=True)
class DataSpec:
    """A parsed, checked data spec (see the module docstring)."""

    sources: tuple[SourceSpec, ...]
    buckets: tuple[Bucket, ...] = ()
    schedule: tuple[Phase, ...] = ()
    origin: str = "<spec>"
    plane: PlaneSpec = PlaneSpec()
    streams: tuple[str, ...] = field(init=False)

    def __post_init__(self) -> None:
        names = [
            f"{s.name}/{b.name}" if self.buckets else s.name
            for s in self.sources
            for b in (self.buckets or (None,))
        ]
        object.__setattr__(self, "streams", tuple(names))

    def stream_source(self, stream: int) -> int:
        """The source index of stream `stream` (streams run source-major, bucket-minor)."""
        return stream // max(1, len(self.buckets))

    def bucket_of(self, lengths) -> list[int]:
        """The bucket index of each sequence length (all 0 without buckets)."""
        out = []
        for n in lengths:
            for k, bucket in enumerate(self.buckets):
                if bucket.max_tokens is None or n <= bucket.max_tokens:
                    out.append(k)
                    break
        return out if self.buckets else [0] * len(lengths)

    def phase_weights(self) -> list[tuple[int | None, Mapping[str, float]]]:
        """`(until_step, weights by name)` per phase; one open-ended phase without a schedule."""
        if not self.schedule:
            return [(None, {s.name: s.weight for s in self.sources})]
        return [(p.until_step, p.weights) for p in self.schedule]

    def stream_weights(self, weights: Mapping[str, float], stream_tokens: Sequence[int]):
        """One weight per stream from weights by source or stream name.

        A source's weight is split over its streams in proportion to `stream_tokens` (the
        training tokens of each stream); a stream named alone keeps its own weight.
        """
        out = [0.0] * len(self.streams)
        per_source = max(1, len(self.buckets))
        for name, weight in weights.items():
            if name in self.streams:
                out[self.streams.index(name)] += weight
                continue
            source = [s.name for s in self.sources].index(name)
            members = range(source * per_source, (source + 1) * per_source)
            total = sum(stream_tokens[k] for k in members)
            for k in members:
                out[k] += weight * (stream_tokens[k] / total) if total else 0.0
        return out

    def check_covers(self, train_iters: int) -> None:
        """ValueError if the schedule ends before step `train_iters`."""
        if self.schedule and self.schedule[-1].until_step < train_iters:
            raise ValueError(
                f"data spec {self.origin}: the schedule ends at step "
                f"{self.schedule[-1].until_step}, but --train-iters is {train_iters}; add a "
                "phase that reaches it"
            )


def _fail(origin: str, message: str) -> ValueError:
    return ValueError(f"data spec {origin}: {message}")


def _weight(origin: str, where: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _fail(origin, f"{where} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise _fail(origin, f"{where} must be finite and >= 0, got {value!r}")
    return float(value)


def _source(origin: str, index: int, raw, base: Path) -> SourceSpec:
    if not isinstance(raw, dict):
        raise _fail(origin, f"sources[{index}] must be an object, got {raw!r}")
    unknown = sorted(set(raw) - _SOURCE_KEYS)
    if unknown:
        raise _fail(origin, f"sources[{index}] has unknown keys {unknown}")
    name = raw.get("name")
    if not isinstance(name, str) or not name or "/" in name:
        raise _fail(origin, f"sources[{index}] needs a 'name' without '/', got {name!r}")
    kinds = [k for k in ("path", "jsonl", "builtin", "synthetic") if raw.get(k) is not None]
    if len(kinds) != 1:
        raise _fail(origin, f"source {name!r} needs exactly one of path, jsonl, builtin, synthetic")
    if kinds[0] != "jsonl" and ("tokenize" in raw or "json_key" in raw):
        raise _fail(origin, f"source {name!r}: tokenize and json_key are for jsonl sources")
    loaders, most = _loaders(origin, name, raw.get("loaders", 1))
    cpus = raw.get("cpus", DEFAULT_LOADER_CPUS)
    if isinstance(cpus, bool) or not isinstance(cpus, int | float) or not 0 < cpus <= 1024:
        raise _fail(
            origin,
            f"source {name!r}: cpus must be a number above 0 (CPUs each of its loaders asks "
            f"Ray for), got {cpus!r}",
        )
    weight = _weight(origin, f"source {name!r} weight", raw.get("weight", 1.0))
    loaders = {"loaders": loaders, "max_loaders": most, "cpus": float(cpus)}

    def resolve(p) -> str:
        if not isinstance(p, str) or not p:
            raise _fail(origin, f"source {name!r}: a path must be a non-empty string, got {p!r}")
        return str(base / p) if not Path(p).is_absolute() else p

    if kinds[0] == "builtin":
        if raw["builtin"] not in BUILTIN_SOURCES:
            raise _fail(
                origin,
                f"source {name!r}: builtin must be one of {BUILTIN_SOURCES}, "
                f"got {raw['builtin']!r}",
            )
        return SourceSpec(name, weight, builtin=raw["builtin"], **loaders)
    if kinds[0] == "synthetic":
        params = _synthetic(origin, name, raw["synthetic"])
        return SourceSpec(name, weight, synthetic=params, **loaders)
    if kinds[0] == "path":
        return SourceSpec(name, weight, path=resolve(raw["path"]), **loaders)
    files = raw["jsonl"] if isinstance(raw["jsonl"], list) else [raw["jsonl"]]
    if not files:
        raise _fail(origin, f"source {name!r}: jsonl names no file")
    key = raw.get("json_key", "text")
    if not isinstance(key, str) or not key:
        raise _fail(origin, f"source {name!r}: json_key must be a non-empty string")
    tokenize = raw.get("tokenize", "on_open")
    if tokenize not in TOKENIZE_MODES:
        raise _fail(
            origin, f"source {name!r}: tokenize must be one of {TOKENIZE_MODES}, got {tokenize!r}"
        )
    return SourceSpec(
        name,
        weight,
        jsonl=tuple(resolve(f) for f in files),
        json_key=key,
        tokenize=tokenize,
        **loaders,
    )


def _count(value) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and 1 <= value <= MAX_LOADERS


def _loaders(origin: str, name: str, raw) -> tuple[int, int | None]:
    """`(min, max)` from `loaders: N` (fixed: max None) or `loaders: {min, max}`."""
    if isinstance(raw, dict):
        unknown = sorted(set(raw) - {"min", "max"})
        low, high = raw.get("min", 1), raw.get("max")
        if unknown or not _count(low) or not _count(high) or high < low:
            raise _fail(
                origin,
                f"source {name!r}: loaders {{min, max}} must be integers with 1 <= min <= max "
                f"<= {MAX_LOADERS} (only those keys), got {raw!r}",
            )
        return low, high
    if not _count(raw):
        raise _fail(
            origin,
            f"source {name!r}: loaders must be an integer from 1 to {MAX_LOADERS} (Ray actors "
            f"per source) or {{min, max}}, got {raw!r}",
        )
    return raw, None


#: `data_plane` knobs: (smallest, largest, integer?) of each.
_PLANE_KNOBS = {
    "cpus": (1e-9, 1e6, False),
    "interval_s": (0.01, 3600.0, False),
    "scale_up_busy": (1e-9, 1.0, False),
    "scale_down_busy": (0.0, 1.0, False),
    "scale_up_wait": (1e-9, 1.0, False),
    "patience": (1, 1000, True),
    "cooldown": (0, 1000, True),
}


def _plane(origin: str, raw) -> PlaneSpec:
    """The checked `data_plane` object (`PlaneSpec`)."""
    if raw is None:
        return PlaneSpec()
    if not isinstance(raw, dict):
        raise _fail(origin, f"data_plane must be an object, got {raw!r}")
    unknown = sorted(set(raw) - set(_PLANE_KNOBS))
    if unknown:
        raise _fail(
            origin, f"data_plane has unknown keys {unknown} (known: {sorted(_PLANE_KNOBS)})"
        )
    for key, value in raw.items():
        low, high, integer = _PLANE_KNOBS[key]
        kind = int if integer else int | float
        if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
            what = "an integer" if integer else "a number"
            raise _fail(
                origin, f"data_plane {key} must be {what} from {low:g} to {high:g}, got {value!r}"
            )
    plane = PlaneSpec(**raw)
    if plane.scale_down_busy >= plane.scale_up_busy:
        raise _fail(
            origin,
            f"data_plane scale_down_busy ({plane.scale_down_busy:g}) must be below "
            f"scale_up_busy ({plane.scale_up_busy:g}), or every measurement scales",
        )
    return plane


def _synthetic(origin: str, name: str, raw) -> tuple[tuple[str, float], ...]:
    """A synthetic source's checked fields, defaults filled in, as sorted pairs."""
    if not isinstance(raw, dict):
        raise _fail(origin, f"source {name!r}: synthetic must be an object, got {raw!r}")
    unknown = sorted(set(raw) - set(SYNTHETIC_DEFAULTS))
    if unknown:
        raise _fail(
            origin,
            f"source {name!r}: synthetic has unknown keys {unknown} "
            f"(known: {sorted(SYNTHETIC_DEFAULTS)})",
        )
    params = {**SYNTHETIC_DEFAULTS, **raw}
    for key, value in params.items():
        if key in SYNTHETIC_COSTS:
            params[key] = _weight(origin, f"source {name!r} synthetic {key}", value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise _fail(
                origin, f"source {name!r}: synthetic {key} must be an integer >= 0, got {value!r}"
            )
    if params["documents"] < 1 or not 2 <= params["min_tokens"] <= params["max_tokens"]:
        raise _fail(
            origin,
            f"source {name!r}: synthetic needs documents >= 1 and 2 <= min_tokens <= "
            f"max_tokens, got {params['documents']}, {params['min_tokens']}, "
            f"{params['max_tokens']}",
        )
    if params["vocab"] < 2:
        raise _fail(origin, f"source {name!r}: synthetic vocab must be >= 2 (ids and the EOD)")
    return tuple(sorted(params.items()))


def _buckets(origin: str, raw) -> tuple[Bucket, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or not raw:
        raise _fail(origin, f"length_buckets must be a non-empty list, got {raw!r}")
    buckets, previous = [], 0
    for k, item in enumerate(raw):
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            raise _fail(origin, f"length_buckets[{k}] needs a 'name', got {item!r}")
        unknown = sorted(set(item) - {"name", "max_tokens"})
        if unknown:
            raise _fail(origin, f"length_buckets[{k}] has unknown keys {unknown}")
        limit = item.get("max_tokens")
        last = k == len(raw) - 1
        if last and limit is not None:
            raise _fail(
                origin,
                f"the last length bucket ({item['name']!r}) takes any length: "
                "leave out its max_tokens",
            )
        if not last and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit <= previous
        ):
            raise _fail(
                origin,
                f"length bucket {item['name']!r}: max_tokens must be an integer above "
                f"{previous}, got {limit!r}",
            )
        buckets.append(Bucket(item["name"], limit))
        previous = limit or previous
    names = [b.name for b in buckets]
    if len(set(names)) != len(names) or any("/" in n for n in names):
        raise _fail(origin, f"length bucket names must be distinct and without '/': {names}")
    return tuple(buckets)


def _phase_weights(origin: str, where: str, raw, known: Sequence[str]) -> dict[str, float]:
    if not isinstance(raw, dict) or not raw:
        raise _fail(origin, f"{where} needs a non-empty 'weights' object, got {raw!r}")
    for name in raw:
        if name not in known:
            raise _fail(
                origin,
                f"{where} names {name!r}, which is no source or stream of this spec "
                f"(known: {', '.join(known)})",
            )
    weights = {name: _weight(origin, f"{where} weight of {name!r}", w) for name, w in raw.items()}
    if sum(weights.values()) <= 0:
        raise _fail(origin, f"{where}: the weights are all zero")
    return weights


def parse_spec(data, *, origin: str = "<spec>", base: str | Path = ".") -> DataSpec:
    """A `DataSpec` from parsed JSON/YAML `data`; relative paths are taken from `base`.

    Raises:
        ValueError: Naming the spec (`origin`) and the bad entry.
    """
    if not isinstance(data, dict):
        raise _fail(origin, "the top level must be an object with 'sources'")
    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise _fail(origin, f"unknown keys {unknown} (known: {sorted(_TOP_KEYS)})")
    raw_sources = data.get("sources")
    if not isinstance(raw_sources, list) or not raw_sources:
        raise _fail(origin, "'sources' must be a non-empty list")
    sources = tuple(_source(origin, k, raw, Path(base)) for k, raw in enumerate(raw_sources))
    names = [s.name for s in sources]
    if len(set(names)) != len(names):
        raise _fail(origin, f"source names must be distinct: {names}")
    buckets = _buckets(origin, data.get("length_buckets"))
    plane = _plane(origin, data.get("data_plane"))
    if plane.cpus is not None:
        need = sum((s.loaders + 1) * s.cpus for s in sources)  # the start, shadows included
        if need > plane.cpus + 1e-9:
            raise _fail(
                origin,
                f"data_plane cpus {plane.cpus:g} is below what the loaders start with: {need:g} "
                "(each source's min loaders and its shadow, times its cpus)",
            )
    spec = DataSpec(sources, buckets, origin=origin, plane=plane)
    known = [*names, *(s for s in spec.streams if s not in names)]
    raw_schedule = data.get("schedule")
    phases: list[Phase] = []
    if raw_schedule is None:
        if sum(s.weight for s in sources) <= 0:
            raise _fail(origin, "the source weights are all zero")
    else:
        if not isinstance(raw_schedule, list) or not raw_schedule:
            raise _fail(origin, f"schedule must be a non-empty list, got {raw_schedule!r}")
        previous = 0
        for k, item in enumerate(raw_schedule):
            until = item.get("until_step") if isinstance(item, dict) else None
            unknown = sorted(set(item) - {"until_step", "weights"}) if until is not None else []
            if unknown:
                raise _fail(origin, f"schedule[{k}] has unknown keys {unknown}")
            if isinstance(until, bool) or not isinstance(until, int) or until <= previous:
                raise _fail(
                    origin,
                    f"schedule[{k}] needs an integer until_step above {previous}, got {until!r}",
                )
            weights = _phase_weights(origin, f"schedule[{k}]", item.get("weights"), known)
            phases.append(Phase(until, weights))
            previous = until
    return DataSpec(sources, buckets, tuple(phases), origin=origin, plane=plane)


def load_spec(path: str | Path) -> DataSpec:
    """Read and check a JSON (`.json`) or YAML (`.yaml`/`.yml`) data spec.

    Relative source paths are taken from the spec file's folder.

    Raises:
        ValueError: Naming the file and what is wrong (unreadable, not JSON/YAML, bad entry).
    """
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ValueError(f"data spec {str(path)!r} cannot be read: {exc.strerror}") from exc
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise ValueError(
                f"data spec {str(path)!r} is YAML, which needs PyYAML (pip install pyyaml)"
            ) from None
        try:
            data = yaml.load(text, Loader=_yaml_loader(yaml))
        except yaml.YAMLError as exc:
            raise ValueError(
                f"data spec {str(path)!r} is not valid YAML: {_one_line(exc)}"
            ) from None
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"data spec {str(path)!r} is not valid JSON: {exc}") from None
    return parse_spec(data, origin=repr(str(path)), base=path.parent)


def _one_line(exc) -> str:
    """PyYAML's error (several lines, with a caret drawing) as `line L, column C: problem`."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
    if mark is None:
        return problem
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}"


def _yaml_loader(yaml):
    """PyYAML's safe loader that also reads `1e-3` and `1.5e3` as numbers, as JSON does."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FORM, list("-+0123456789."))
    return Loader
