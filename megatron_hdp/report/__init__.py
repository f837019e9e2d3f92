"""What a training run did, in numbers (pure: numpy and the planner, no torch).

- `prediction`: the cost model's step time and the ring attention bytes of a plan, and the
  static mesh the run is compared with.
- `timeline`: one step's per-rank micro-batch times, measured beside the plan's prediction
  (the JSON files `python -m megatron_hdp.plot` draws).
- `summary`: the end-of-run summary, computed from the per-step metrics records.
"""
