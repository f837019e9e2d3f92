"""Everything from documents to one rank's tokens of a step, in one package.

- pure (numpy): `sampler` (global batches by token budget; streams and schedules),
  `spec` (the declarative data spec), `corpus` (document sources, the embedded corpus),
  `tokenizers`, `prefetch` (batches prepared ahead in a thread);
- host: `indexed` (Megatron indexed datasets), `preprocess` (the preprocessing tool),
  `sources` (a spec's source readers), `training_data` (the job's datasets and samplers),
  `batching` (one rank's share of a micro-batch as THD tensors), `loader` (sampler -> plan
  -> tokens, for the job and the drop-in), `iterator` (the Megatron-LM drop-in's
  `HDPDataIterator`), `service/` (the optional Ray data service).
"""
