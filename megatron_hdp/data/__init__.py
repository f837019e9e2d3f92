"""Data layer (pure): tokenizers and document sources for HDP training jobs.

The Megatron-facing half (indexed `.bin`/`.idx` datasets, the preprocessing tool) lives in
`megatron_hdp.megatron.indexed` and `megatron_hdp.megatron.preprocess`.
"""
