"""Selective activation offloading (ops layer, torch only; ByteScale section 3.3).

- `host_pool`: `HostBufferPool`, one host slab of exactly the budget, allocated (and on
  CUDA pinned) once when an engine is constructed, carved into aligned reusable blocks.
- `engines`: copy engines that move tensors between the device and host memory, both into
  blocks of their pool. `HostCopyEngine` is synchronous (CPU runs and tests);
  `CudaCopyEngine` copies on two side streams.
- `hooks`: `OffloadManager`, which hooks the transformer layers' forward passes with
  `torch.autograd.graph.saved_tensors_hooks`, sends the first `ceil(ratio * rows)` rows
  of each saved activation of the early layers to the injected engine, prefetches them
  one layer ahead in the backward pass, and accounts the resident saved-activation bytes.

The policy (which ratio a micro-batch gets) lives in the planner; this package is only the
mechanism and never imports Megatron or `torch.distributed`.
"""
