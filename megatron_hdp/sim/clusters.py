"""Cluster profiles for the simulator, expressed as the cost model's `DeviceProfile` (pure).

A profile describes one HDP rank: a model replica of TP x PP GPUs. Per-GPU constants
(H100 SXM class node, the paper withholds its hardware; bytescale-paper.md section 7.14):

- 989 TFLOP/s dense bf16 per GPU (NVIDIA H100 SXM datasheet); GEMM efficiency 0.6 and
  attention efficiency 0.4, the values of `cost.H100` (typical Megatron MFU and
  FlashAttention-2 forward + backward).
- 8 GPUs per node on NVLink 4 (900 GB/s per GPU, datasheet): TP stays inside the node.
- 400 Gb/s InfiniBand NDR per GPU (one ConnectX-7 per GPU, the DGX H100 reference design)
  = 50 GB/s per direction; ~10 us per message (`cost.H100`).
- PCIe Gen5 x16 host link, ~50 GB/s effective per direction (`cost.H100`), shared by the
  host copies of offloading and the GPU's GPUDirect RDMA traffic to its NIC (GPU and
  ConnectX-7 behind one PCIe switch, the DGX H100 topology; `DeviceProfile.host_link_shared`).
- 80 GB HBM3 per GPU; 2 TB host memory per 8-GPU node (DGX H100: 2 TB), half of a GPU's
  share (128 GB) for offloaded activations (`cost.H100`).

Scaling to an HDP rank of TP x PP GPUs (stated assumptions):
- The cost model prices a micro-batch on ONE pipeline stage's TP group (`rank_profile`):
  FLOP/s x TP x `tp_efficiency` (0.9 for TP > 1: TP all-reduces over NVLink partly
  exposed; our choice, not fitted), ring link = InfiniBand per GPU x TP, host link = PCIe
  per GPU x TP, device and host memory x TP. Its time `c` is then the whole model's forward
  + backward on those devices, and a stage of a PP replica takes `c / PP` (uniform stages:
  `scheduler.pipeline_timeline`). Each stage's GPUs send their own layers' K/V over their
  own NICs, so per layer the ring time is the stage's, exactly as priced.
- Pipeline parallelism is not an efficiency factor: every simulated step of a PP model
  runs the plan's micro-batch lists through Megatron's 1F1B schedule stage by stage
  (`pipeline_timeline.execute`), with rings synchronised on every stage, so fill and drain
  bubbles, stalls behind heavy micro-batches and ring waits are all explicit.
- Rings cross nodes (a ring neighbour is another replica, in general on another node).
- The gradient sync is a ring all-reduce of each stage's gradients (the replica's over PP)
  over the pool on that stage's links, all stages at once:
  `2 (N - 1) / N x gradient bytes / PP / ring bandwidth + 2 (N - 1) x latency`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from megatron_hdp.scheduler.cost import DeviceProfile


@dataclass(frozen=True)
class Cluster:
    """Per-GPU constants of a cluster (see the module docstring for sources)."""

    name: str
    peak_flops: float = 989e12
    linear_efficiency: float = 0.6
    attention_efficiency: float = 0.4
    gpus_per_node: int = 8
    nvlink_bandwidth: float = 450e9  # per direction (900 GB/s bidirectional)
    ib_bandwidth: float = 50e9  # 400 Gb/s per GPU, per direction
    ib_latency: float = 10e-6
    host_bandwidth: float = 50e9  # PCIe Gen5 x16 effective, per direction
    host_link_shared: bool = True  # the NIC's traffic crosses the same PCIe link
    gpu_memory: float = 80e9
    host_memory_per_gpu: float = 128e9
    tp_efficiency: float = 0.9

    def gpu_profile(self) -> DeviceProfile:
        """The `DeviceProfile` of one GPU of this cluster."""
        return DeviceProfile(
            name=self.name,
            linear_flops=self.linear_efficiency * self.peak_flops,
            attention_flops=self.attention_efficiency * self.peak_flops,
            p2p_bandwidth=self.ib_bandwidth,
            p2p_latency=self.ib_latency,
            host_bandwidth=self.host_bandwidth,
            memory_bytes=self.gpu_memory,
            host_memory_bytes=self.host_memory_per_gpu,
            bytes_per_element=2,
            host_link_shared=self.host_link_shared,
        )

    def rank_profile(self, tp: int) -> DeviceProfile:
        """The `DeviceProfile` the cost model prices with: one pipeline stage of `tp` GPUs.

        For a model without PP that is the whole HDP rank; with PP, a stage of the replica
        (see the module docstring: stages are priced by the 1F1B timeline, not here).
        """
        if tp > self.gpus_per_node:
            raise ValueError(f"TP {tp} exceeds the {self.gpus_per_node} GPUs of an NVLink node")
        profile = self.gpu_profile().replica(tp, tp_efficiency=self.tp_efficiency)
        return replace(profile, name=f"{self.name}-tp{tp}")

    def scaled(self, **changes) -> Cluster:
        """A copy with some constants changed (e.g. `ib_bandwidth` for sensitivity runs)."""
        return replace(self, **changes)


H100_CLUSTER = Cluster(name="h100")
CLUSTERS = {"h100": H100_CLUSTER}
