"""megatron_hdp: Hybrid Data Parallelism (ByteScale) for Megatron-Core.

Importing the package has no side effects: Megatron is only imported by
`megatron_hdp.megatron`, and CPU shims are applied only when asked for.
"""

__version__ = "0.1.0"
