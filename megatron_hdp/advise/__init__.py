"""`python -m megatron_hdp.advise`: "will HDP pay on my job?" (see docs/advise.md).

The cluster simulator (`megatron_hdp.sim`) run on the user's own global batches, model and
cluster. Layers, lightest first:

- `profiles`: GPU profiles by name (datasheet constants, cited) or from a JSON file (pure).
- `job`: the job's Megatron flags -> model shape, pool, capacity, static CP, memory (pure).
- `lengths`: global batches of sequence lengths: a lengths file or a built-in mix (pure),
  or the job's own `--data-path` / `--hdp-data-spec` through the project's data layer
  (`batches_from_job_data`, which imports the data layer and so torch, lazily).
- `budget`: what a simulation will hold and take, estimated from the lengths file's pieces,
  the batch's sequences and the pool, and checked against the memory this process may
  still take, before any work (pure).
- `run`: every system simulated on the same batches, with the extra per-system figures
  the report needs (pure).
- `report`: JSON, markdown table and the plain-language verdict (pure).
- `pictures`: Gantt PNGs of one step (matplotlib, imported when drawing).
- `__main__`: the command line (validation, progress bar, output folder, PNGs).
"""
