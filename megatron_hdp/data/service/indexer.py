"""The lengths index of a JSONL source, built once for the job in the Ray cluster.

With the data service a rank holds a JSONL source's lengths only (`data.lengths_only`).
Where its lengths index is not cached yet, every rank asks one `LengthsIndexer` actor,
named after the source's files, JSON key and tokenizer (Ray's `get_if_exists`: the first
rank to ask starts it, the others get the same one). The actor builds the index once (one
document at a time, writing the cache the loaders then read, `sources.lengths_index`) and
answers every rank with the lengths: no rank opens or tokenizes the documents.
No collective runs here.
"""

from __future__ import annotations

import functools
import hashlib
import json

from megatron_hdp.data.spec import SourceSpec
from megatron_hdp.errors import DataServiceError

#: The indexers this process asked, by name: the rank that started one keeps it alive (Ray
#: ends an actor once its owner holds no handle) until the other ranks have their answer.
_HANDLES: dict[str, object] = {}


class LengthsIndexer:
    """Builds one JSONL source's lengths index, once, and hands out its lengths (Ray actor)."""

    def __init__(self, source: SourceSpec, open_args: dict) -> None:
        self.source, self.open_args, self._lengths = source, open_args, None

    def lengths(self):
        """The source's document lengths (building and caching its index on the first call)."""
        from megatron_hdp.data.sources import lengths_index
        from megatron_hdp.data.tokenizers import build_tokenizer

        if self._lengths is None:
            tokenizer = build_tokenizer(
                self.open_args["tokenizer_type"], tokenizer_model=self.open_args["tokenizer_model"]
            )
            self._lengths = lengths_index(
                self.source.jsonl,
                json_key=self.source.json_key,
                tokenizer=tokenizer,
                cache_dir=self.open_args["cache_dir"],
            )["lengths"]
        return self._lengths


def release_indexers() -> None:
    """Drop this process's indexer handles, once every rank has its lengths.

    Ray then ends the indexers this process started.
    """
    _HANDLES.clear()


def indexer_name(source: SourceSpec, open_args: dict) -> str:
    """The actor's name: a hash of the files, the JSON key and the tokenizer."""
    key = json.dumps(
        [list(source.jsonl), source.json_key, open_args["tokenizer_type"],
         open_args["tokenizer_model"], str(open_args["cache_dir"])]
    )  # fmt: skip
    return "lengths-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def cluster_lengths(address: str, open_args: dict, *, timeout_s: float):
    """`build(source)` for `lengths_only.open_lengths`: the lengths from the cluster's indexer.

    Picklable (a `functools.partial`). Joins the Ray cluster at `address` (bounded,
    `client._init`) on first use.
    """
    return functools.partial(_cluster_lengths, address, open_args, timeout_s)


def _cluster_lengths(address: str, open_args: dict, timeout_s: float, source: SourceSpec):
    """The lengths of JSONL `source` from the job's `LengthsIndexer` for it.

    Raises the indexer's ValueError for bad data (a malformed line, named by file and
    line), DataServiceError naming the source if the indexer fails otherwise or does not
    answer within `timeout_s`.
    """
    import ray

    from megatron_hdp.data.service.client import NAMESPACE, _first_line, _init

    _init(address)
    name = indexer_name(source, open_args)
    actor = ray.remote(LengthsIndexer).options(
        name=name, namespace=NAMESPACE, get_if_exists=True, num_cpus=0
    )
    indexer = _HANDLES[name] = actor.remote(source, open_args)
    try:
        return ray.get(indexer.lengths.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as err:
        raise DataServiceError(
            f"data source {source.name!r}: the Ray cluster did not build its lengths index "
            f"within {timeout_s:g} s"
        ) from err
    except ray.exceptions.RayError as err:
        if isinstance(getattr(err, "cause", None), ValueError):  # bad data, named
            raise ValueError(str(err.cause)) from err  # open_lengths names the source
        raise DataServiceError(
            f"data source {source.name!r}: building its lengths index in the Ray cluster "
            f"failed ({_first_line(err)})"
        ) from err
