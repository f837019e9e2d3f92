"""The Ray data service (optional; `--hdp-data-service ray`).

- `address`: finding and checking the Ray cluster's address (no Ray import).
- `actors`: the planner actor (builds each global batch and its plan once, for all ranks,
  and supervises the source loaders; restarted once by Ray if it dies) and the
  source-loader actors (one source each).
- `indexer`: a JSONL source's lengths index, built once in the cluster for the ranks
  (which hold lengths only, `data.lengths_only`).
- `autoscale`: the scaling policy (pure): measurements in, loader-count decisions out.
- `scaling`: the planner's part that measures loaders and ranks' data wait and carries
  the decisions out (warm shadow promotion, repartition by routing versions).
- `client`: what a trainer rank runs: fetch the step's plan, read its own micro-batches'
  tokens from the loaders, replace a loader that died by its shadow.
"""
