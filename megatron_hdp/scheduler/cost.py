"""The cost model shared by the planner, the benchmarks and the simulator (pure).

Time of one sequence of `s` tokens on a ring of `k` ranks, per member, forward + backward,
all layers of one model replica (an HDP rank):

    T(s, k) = linear(s) / k + attention(s) / k + exposed_ring(s, k)

- `linear(s) = 6 * P * s / F_lin`: GEMMs of all layers and the output layer (P parameters
  touched per token; 2 FLOPs per multiply-add, x3 for forward + backward). For MoE, P counts
  the router and the top-k experts a token runs through, not all experts.
- `attention(s) = L * 3.5 * s^2 * H * (d_qk + d_v) / F_attn`: causal attention scores
  (`2 s^2 H d_qk`) and values (`2 s^2 H d_v`), forward FLOPs halved by the causal mask,
  backward 2.5x forward. `d_qk = d_v` = the head dim, except with multi-latent attention
  (q/k `qk_head_dim + qk_pos_emb_head_dim`, v `v_head_dim`); where the job's kernel runs v
  zero-padded to the q/k dim (`ModelShape.padded_v`, `kernels.head_dims`) `d_v = d_qk`.
- multi-token prediction (`ModelShape.mtp_num_layers`): each depth adds a layer priced as a
  full-attention layer (compute and ring) plus its input projection (`2h x h`)
  and the output layer (`h x V`) to the GEMMs.
- sliding-window layers (`ModelShape.window`, `windowed_layers`) compute only the pairs
  within their window and their rings carry only the rows later windows reach
  (`scheduler.windows`).
- `exposed_ring(s, k)`: each layer's ring has `k - 1` forward steps moving K/V of `s/k`
  tokens and, backward, `k - 1` K/V steps plus `k` dK/dV steps; a step costs
  `latency + bytes / bandwidth` and hides behind that step's share of attention compute,
  only the excess is exposed. Zero for `k = 1`. A message holds K and V of every local
  token, `G * (d_qk + d_v)` elements (`kv_message_dim`); MLA ships per-head K/V (G = H),
  not its latent.

Activation bytes per token and layer follow field-anchors.md 5.4: about `34 h` bytes in
16-bit (scaled by the element size). Constants of the named device profiles are documented
where they are defined; `cpu` is a placeholder to be replaced by a calibration run
(`python -m megatron_hdp.megatron.calibrate`), which writes a profile JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from megatron_hdp.scheduler.windows import attention_pairs, window_ring_rows


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    """The dimensions the cost model needs (Megatron flag names)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int | None = None
    kv_channels: int | None = None
    """Channels per head; None: hidden / heads (--kv-channels)."""
    ffn_hidden_size: int | None = None
    vocab_size: int = 32000
    swiglu: bool = True
    num_experts: int | None = None
    """Experts per MoE layer; None: a dense MLP."""
    moe_router_topk: int = 2
    """Experts each token runs through (MoE)."""
    moe_ffn_hidden_size: int | None = None
    """Hidden size of each expert; None: `ffn_hidden_size`."""
    window: int | None = None
    """Sliding window of the windowed layers (--window-size's left; `scheduler.windows`)."""
    windowed_layers: int = 0
    """How many layers attend within `window` (Megatron-Core's --window-attn-skip-freq rule,
    `windows.windowed_layers`); the others attend in full."""
    multi_latent_attention: bool = False
    """Megatron-Core's MLA: the fields below replace kv_channels and the query groups."""
    q_lora_rank: int | None = None
    """MLA: rank of the queries' projection; None: one full projection."""
    kv_lora_rank: int = 32
    """MLA: rank of the keys' and values' projection."""
    qk_head_dim: int = 128
    """MLA: query/key channels per head without RoPE."""
    qk_pos_emb_head_dim: int = 64
    """MLA: decoupled RoPE channels per head."""
    v_head_dim: int = 128
    """MLA: value channels per head."""
    padded_v: bool = False
    """The job's attention kernel runs v zero-padded to the q/k head dim (every kernel but
    the CPU `math` one and FlashAttention-4 on Blackwell, `kernels.head_dims`): attention is
    priced at the padded dims. The ring ships K and V unpadded."""
    mtp_num_layers: int = 0
    """Multi-token prediction depths (--mtp-num-layers), each one more transformer layer."""

    @property
    def head_dim(self) -> int:
        """Channels per attention head: kv_channels, else hidden / heads."""
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    @property
    def qk_dim_per_head(self) -> int:
        """Query/key channels of one head: the head dim; MLA's `qk_head_dim + pos`."""
        if self.multi_latent_attention:
            return self.qk_head_dim + self.qk_pos_emb_head_dim
        return self.head_dim

    @property
    def v_dim_per_head(self) -> int:
        """Value (and attention output) channels of one head: the head dim; MLA's v."""
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def attention_dims(self) -> int:
        """`d_qk + d_v` as the attention kernel computes them (v padded with `padded_v`)."""
        v = self.qk_dim_per_head if self.padded_v else self.v_dim_per_head
        return self.qk_dim_per_head + v

    @property
    def layers(self) -> int:
        """Transformer layers a token runs through: the decoder's and the MTP depths'."""
        return self.num_layers + self.mtp_num_layers

    @property
    def q_dim(self) -> int:
        """Channels of Q (and of the attention output) per token: heads x head dim."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        """Channels of K (or V) per token: query groups x head dim."""
        return (self.num_query_groups or self.num_attention_heads) * self.head_dim

    @property
    def kv_message_dim(self) -> int:
        """Elements of K and V together per token, as the ring ships them.

        `2 * kv_dim`; with MLA every head's K and V (`H * (d_qk + d_v)`), not the latent.
        """
        if self.multi_latent_attention:
            return self.num_attention_heads * (self.qk_dim_per_head + self.v_dim_per_head)
        return 2 * self.kv_dim

    @property
    def attention_params(self) -> int:
        """Weights of one layer's attention projections (biases and norms left out).

        MLA: the q projection (down and up with `q_lora_rank`), the kv down projection (with
        the decoupled RoPE channels), the kv up projection and the output projection.
        """
        h = self.hidden_size
        if not self.multi_latent_attention:
            return h * (self.q_dim + 2 * self.kv_dim) + self.q_dim * h
        heads = self.num_attention_heads
        q_out = heads * self.qk_dim_per_head
        q = h * q_out if self.q_lora_rank is None else self.q_lora_rank * (h + q_out)
        kv_down = h * (self.kv_lora_rank + self.qk_pos_emb_head_dim)
        kv_up = self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim)
        return q + kv_down + kv_up + heads * self.v_head_dim * h

    @property
    def params_per_token(self) -> int:
        """Weights each token multiplies: all transformer layers plus the output layer.

        With experts these are the ACTIVE weights: the router (h x E) and top-k experts.
        Each MTP depth adds a layer, its input projection (2h x h) and the output layer.
        """
        h, ffn = self.hidden_size, self.ffn_hidden_size or 4 * self.hidden_size
        attention = self.attention_params
        per_mlp = 3 if self.swiglu else 2
        if self.num_experts is None:
            mlp = per_mlp * h * ffn
        else:
            expert_ffn = self.moe_ffn_hidden_size or ffn
            mlp = h * self.num_experts + self.moe_router_topk * per_mlp * h * expert_ffn
        mtp = self.mtp_num_layers * (2 * h * h + h * self.vocab_size)
        return self.layers * (attention + mlp) + h * self.vocab_size + mtp


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """Effective speeds of one HDP rank (a model replica's device).

    Attributes:
        name: Profile name.
        linear_flops: Sustained FLOP/s of the GEMMs.
        attention_flops: Sustained FLOP/s of the attention kernel.
        p2p_bandwidth: Bytes/s of one ring link, one direction.
        p2p_latency: Seconds per ring message.
        host_bandwidth: Bytes/s device-to-host (and back), for offloading.
        memory_bytes: Device memory.
        host_memory_bytes: Host memory one rank may fill with offloaded activations.
        bytes_per_element: 2 for bf16 activations, 4 for fp32.
        host_link_shared: The host copies and the ring's network traffic cross one link
            (a GPU's PCIe link carries both its D2H/H2D copies and, through the PCIe
            switch, its GPUDirect RDMA traffic to the NIC): offloading's copies then
            compete with the ring's K/V for `host_bandwidth` (`CostModel.offload_copy_time`).
    """

    name: str
    linear_flops: float
    attention_flops: float
    p2p_bandwidth: float
    p2p_latency: float
    host_bandwidth: float
    memory_bytes: float
    host_memory_bytes: float = 64e9
    bytes_per_element: int = 2
    host_link_shared: bool = False

    def replica(
        self, tp: int, pp: int = 1, *, tp_efficiency: float = 0.9, pp_efficiency: float = 0.9
    ) -> DeviceProfile:
        """The profile of an HDP rank made of `tp x pp` devices of this profile.

        Stated assumptions (shared by the training job and the simulator): FLOP/s add up
        over the devices, times `tp_efficiency` for TP > 1 (the TP all-reduces are partly
        exposed) and `pp_efficiency` for PP > 1 (bubble, stage imbalance); ring, host links
        and memories add up too, since each device sends its own shard of the ring's K/V
        (its heads, its layers) over its own link to the same device of the neighbour.
        """
        if tp < 1 or pp < 1:
            raise ValueError(f"tp and pp must be >= 1, got tp={tp} pp={pp}")
        if tp == pp == 1:
            return self
        devices = tp * pp
        eff = (tp_efficiency if tp > 1 else 1.0) * (pp_efficiency if pp > 1 else 1.0)
        return replace(
            self,
            name=f"{self.name}-tp{tp}pp{pp}",
            linear_flops=self.linear_flops * devices * eff,
            attention_flops=self.attention_flops * devices * eff,
            p2p_bandwidth=self.p2p_bandwidth * devices,
            host_bandwidth=self.host_bandwidth * devices,
            memory_bytes=self.memory_bytes * devices,
            host_memory_bytes=self.host_memory_bytes * devices,
        )

    def to_json(self) -> str:
        """JSON text of the profile."""
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, path: str | Path) -> DeviceProfile:
        """Load a profile written by `to_json` (e.g. by the calibration command)."""
        return cls(**json.loads(Path(path).read_text()))


#: H100 SXM: 989 TFLOP/s dense bf16 (datasheet); 60% GEMM and 40% attention efficiency
#: (typical Megatron MFU and FlashAttention-2 forward+backward); 50 GB/s per direction to a
#: ring neighbour on another node (400 Gb/s InfiniBand NDR per GPU); ~10 us per message;
#: PCIe Gen5 x16 ~50 GB/s effective per direction; 80 GB HBM3; 2 TB of host memory per
#: 8-GPU node, half of a GPU's share (128 GB) for offloaded activations. The host link is
#: shared with the NIC: in the DGX H100 / HGX reference topology each GPU and its ConnectX-7
#: sit behind one PCIe Gen5 switch, so GPUDirect RDMA and host copies both cross the GPU's
#: one x16 link (NVIDIA DGX H100 User Guide, "System Topology").
H100 = DeviceProfile(
    name="h100",
    linear_flops=0.6 * 989e12,
    attention_flops=0.4 * 989e12,
    p2p_bandwidth=50e9,
    p2p_latency=10e-6,
    host_bandwidth=50e9,
    memory_bytes=80e9,
    host_memory_bytes=128e9,
    host_link_shared=True,
)
#: A100 SXM: 312 TFLOP/s dense bf16; same efficiencies; 200 Gb/s HDR per GPU (25 GB/s);
#: PCIe Gen4 ~25 GB/s; 80 GB HBM2e; 1 TB host memory per node, 64 GB per GPU for offload;
#: GPU and NIC share a PCIe Gen4 switch (DGX A100 User Guide, "Network Connections"), as H100.
A100 = DeviceProfile(
    name="a100",
    linear_flops=0.6 * 312e12,
    attention_flops=0.4 * 312e12,
    p2p_bandwidth=25e9,
    p2p_latency=10e-6,
    host_bandwidth=25e9,
    memory_bytes=80e9,
    host_memory_bytes=64e9,
    host_link_shared=True,
)
#: This machine's kind (2 cores, gloo over loopback), before calibration: ~20 GFLOP/s per
#: rank, gloo P2P ~1 GB/s and ~0.5 ms per message (cpu-gloo-facts.md, section 1), fp32;
#: "host" copies are memcpy (~5 GB/s) into an 8 GB store per rank.
CPU = DeviceProfile(
    name="cpu",
    linear_flops=20e9,
    attention_flops=10e9,
    p2p_bandwidth=1e9,
    p2p_latency=0.5e-3,
    host_bandwidth=5e9,
    memory_bytes=24e9,
    host_memory_bytes=8e9,
    bytes_per_element=4,
)
PROFILES = {p.name: p for p in (H100, A100, CPU)}

_ATTENTION_TRAIN_FACTOR = 3.5  # forward + backward = 3.5 x forward (backward 2.5x)
_BACKWARD_STEP_FACTOR = 2.5


class CostModel:
    """Times and bytes of sequences on rings, for one model on one device profile."""

    def __init__(self, model: ModelShape, device: DeviceProfile) -> None:
        self.model = model
        self.device = device

    def linear_time(self, s: float) -> float:
        """GEMM seconds of a whole sequence of `s` tokens on one rank."""
        return 6.0 * self.model.params_per_token * s / self.device.linear_flops

    def attention_time(self, s: float) -> float:
        """Causal attention seconds of a whole sequence on one rank, all layers.

        Windowed layers compute only the pairs within their window (`windows.attention_pairs`).
        """
        m = self.model
        if self._windowed:
            return self._full_attention_time(s) + self.windowed_attention_time(s)
        forward = s * s * m.num_attention_heads * m.attention_dims
        return m.layers * _ATTENTION_TRAIN_FACTOR * forward / self.device.attention_flops

    @property
    def _windowed(self) -> bool:
        return self.model.window is not None and self.model.windowed_layers > 0

    def _pairs_time(self, pairs, layers: int):
        m = self.model
        forward = 2.0 * pairs * m.num_attention_heads * m.attention_dims
        out = layers * _ATTENTION_TRAIN_FACTOR * forward / self.device.attention_flops
        return float(out) if np.ndim(out) == 0 else out

    def _full_attention_time(self, s):
        """Attention seconds of the layers without a window (MTP layers among them)."""
        layers = self.model.layers - (self.model.windowed_layers if self._windowed else 0)
        return self._pairs_time(attention_pairs(s, None), layers)

    def windowed_attention_time(self, s):
        """Attention seconds of the windowed layers alone (0 without a window)."""
        if not self._windowed:
            return self._pairs_time(np.zeros_like(np.asarray(s, dtype=np.float64)), 0)
        m = self.model
        return self._pairs_time(attention_pairs(s, m.window), m.windowed_layers)

    def _exposed(self, tokens, attention, k, windowed=None):
        """Exposed ring seconds for `tokens` per ring pass hiding behind `attention` seconds.

        With windowed layers, `windowed` is their share of `attention` (default: that of one
        sequence of `tokens`); their rings carry `windows.window_ring_rows` rows per hop and
        hide behind their own attention, the other layers' as without a window.
        """
        if self._windowed:
            return self._exposed_windowed(tokens, attention, k, windowed)
        m, d = self.model, self.device
        k = np.asarray(k, dtype=np.float64)
        ring = k > 1
        k_safe = np.where(ring, k, 2.0)
        kv_bytes = (np.asarray(tokens, dtype=np.float64) / k_safe) * m.kv_message_dim
        transfer = d.p2p_latency + kv_bytes * d.bytes_per_element / d.p2p_bandwidth
        forward_step = attention / (k_safe * k_safe) / (_ATTENTION_TRAIN_FACTOR * m.layers)
        backward_step = forward_step * _BACKWARD_STEP_FACTOR
        per_layer = (
            (k_safe - 1) * np.maximum(0.0, transfer - forward_step)
            + (k_safe - 1) * np.maximum(0.0, 2.0 * transfer - backward_step)
            + transfer
        )
        out = np.where(ring, m.layers * per_layer, 0.0)
        return float(out) if out.ndim == 0 else out

    def _exposed_windowed(self, tokens, attention, k, windowed):
        m, d = self.model, self.device
        tokens = np.asarray(tokens, dtype=np.float64)
        if windowed is None:
            windowed = self.windowed_attention_time(tokens)
        k = np.asarray(k, dtype=np.float64)
        ring = k > 1
        k_safe = np.where(ring, k, 2.0)
        local = tokens / k_safe
        layers_w = m.windowed_layers
        layers_f = m.layers - layers_w

        def per_layer(rows, layer_attention, layers):
            transfer = d.p2p_latency + 2.0 * rows * m.kv_dim * d.bytes_per_element / d.p2p_bandwidth
            forward_step = (
                layer_attention / (k_safe * k_safe) / (_ATTENTION_TRAIN_FACTOR * max(layers, 1))
            )
            backward_step = forward_step * _BACKWARD_STEP_FACTOR
            return (
                (k_safe - 1) * np.maximum(0.0, transfer - forward_step)
                + (k_safe - 1) * np.maximum(0.0, 2.0 * transfer - backward_step)
                + transfer
            )

        windowed = np.asarray(windowed, dtype=np.float64)
        total = layers_f * per_layer(local, np.asarray(attention) - windowed, layers_f)
        total = total + layers_w * per_layer(window_ring_rows(local, m.window), windowed, layers_w)
        out = np.where(ring, total, 0.0)
        return float(out) if out.ndim == 0 else out

    def exposed_ring_time(self, s, k):
        """Ring communication seconds not hidden by attention compute, per member.

        Works on floats or numpy arrays; zero where `k <= 1`.
        """
        if self._windowed:
            return self._exposed(s, self.attention_time(s), k, self.windowed_attention_time(s))
        return self._exposed(s, self.attention_time(s), k)

    def time(self, s, k=1):
        """Per-member seconds of a sequence of `s` tokens on a ring of `k` ranks.

        Works on floats or numpy arrays (elementwise).
        """
        return (self.linear_time(s) + self.attention_time(s)) / np.asarray(
            k, dtype=np.float64
        ) + self.exposed_ring_time(s, k)

    def micro_batch_time(self, lengths: Sequence[int], k: int = 1) -> float:
        """Per-member seconds of a micro-batch of packed documents on a ring of `k`.

        Compute adds up per document; the ring makes one pass per layer for the whole pack
        (one K/V message per step holds every document's chunks, as `hdp_attention` does),
        hidden by the pack's total attention.
        """
        s = np.asarray(lengths, dtype=np.float64)
        attention = float(np.sum(self.attention_time(s)))
        compute = (float(np.sum(self.linear_time(s))) + attention) / k
        if self._windowed:
            windowed = float(np.sum(self.windowed_attention_time(s)))
            return compute + float(self._exposed(float(s.sum()), attention, k, windowed))
        return compute + float(self._exposed(float(s.sum()), attention, k))

    def forward_share(self, lengths: Sequence[int]) -> float:
        """Forward share of a micro-batch's compute: GEMMs 1/3, attention 1/3.5 (this model).

        The split of `micro_batch_time` into a forward and a backward pass, as a pipeline
        schedule needs it (`pipeline_timeline.stage_times`); exposed ring time is split in
        the same proportion.
        """
        s = np.asarray(lengths, dtype=np.float64)
        return float(forward_fraction(np.sum(self.linear_time(s)), np.sum(self.attention_time(s))))

    def activation_bytes_per_token(self) -> float:
        """Saved activation bytes per token, all decoder layers (MTP layers not counted).

        About 34 h per layer in 16-bit.
        """
        m = self.model
        return m.num_layers * 34.0 * m.hidden_size * self.device.bytes_per_element / 2.0

    def offload_copy_time(self, s, k, ratio):
        """Seconds per member that offloading's host copies add to a ring (exposed only).

        A member holds `s / k` tokens; each of the `l - 2` offloadable layers copies a
        `ratio` share of its activations to the host during its forward pass and back
        during the backward pass (two layers stay resident, `offload_rule`). A layer's
        copy hides under that layer's compute on the member (forward, resp. backward)
        plus the ring time the layer already exposes; only the excess is added. With
        `host_link_shared` the ring's K/V bytes of the layer cross the same link in the
        same direction (sends while copying out, receives while copying back), so they
        take their share of `host_bandwidth` first. Zero where `ratio` is 0; floats or
        numpy arrays (elementwise, broadcast).
        """
        m, d = self.model, self.device
        s = np.asarray(s, dtype=np.float64)
        k = np.maximum(np.asarray(k, dtype=np.float64), 1.0)
        ratio = np.asarray(ratio, dtype=np.float64)
        layers = m.num_layers
        tokens = s / k
        copy = ratio * self.activation_bytes_per_token() / layers * tokens / d.host_bandwidth
        linear, attention = self.linear_time(s), self.attention_time(s)
        per_layer = (linear + attention) / (k * m.layers)  # each layer's share, MTP's too
        forward = forward_fraction(linear, attention) * per_layer
        backward = per_layer - forward
        exposed = self.exposed_ring_time(s, k) / m.layers
        exposed_f = forward_fraction(linear, attention) * exposed
        exposed_b = exposed - exposed_f
        ring_f = ring_b = np.zeros_like(tokens)
        if d.host_link_shared:
            step = tokens * m.kv_message_dim * d.bytes_per_element / d.host_bandwidth
            ring_f = np.where(k > 1, (k - 1) * step, 0.0)
            ring_b = np.where(k > 1, (2 * (k - 1) + 1) * step, 0.0)
        windows = ((forward + exposed_f, ring_f), (backward + exposed_b, ring_b))
        extra = sum(
            np.maximum(0.0, copy + ring - window) - np.maximum(0.0, ring - window)
            for window, ring in windows
        )
        out = np.where(ratio > 0, max(0, layers - 2) * extra, 0.0)
        return float(out) if out.ndim == 0 else out

    def planner_cost(self, lengths: Sequence[int], cp_size: int, capacity: int) -> float:
        """`placement.CostFn` adapter: per-member time of a micro-batch."""
        return self.micro_batch_time(lengths, cp_size)

    def cost_arrays(
        self, seqlens: Sequence[int], capacity: int, *, ring_sizes=None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Inputs of the balance core: ring sizes, local costs and per-member ring costs.

        Ring sizes default to `ceil(s / capacity)`; offloading passes smaller ones (the
        ring costs here leave its copies out: `offload_choice.OffloadRingCosts` adds them).
        """
        s = np.asarray(seqlens, dtype=np.float64)
        if ring_sizes is None:
            k = np.maximum(1, np.ceil(s / capacity)).astype(np.int64)
        else:
            k = np.asarray(ring_sizes, dtype=np.int64)
        # time(s, 1) is the compute alone (no ring): one pass, rings priced where k > 1.
        local = np.asarray(self.linear_time(s) + self.attention_time(s), dtype=np.float64)
        ring = np.zeros(len(s))
        wide = np.nonzero(k > 1)[0]
        ring[wide] = self.time(s[wide], k[wide])
        return k, local, ring


def forward_fraction(linear, attention):
    """Forward share of compute made of `linear` GEMM and `attention` seconds (arrays too).

    GEMMs: forward 1/3 of forward + backward; attention: 1/3.5 (`CostModel` above).
    """
    linear = np.asarray(linear, dtype=np.float64)
    attention = np.asarray(attention, dtype=np.float64)
    total = linear + attention
    safe = np.where(total > 0, total, 1.0)
    share = (linear / 3.0 + attention / _ATTENTION_TRAIN_FACTOR) / safe
    return np.where(total > 0, share, 1.0 / 3.0)


def lower_bound(ring_sizes, local_cost, ring_cost, pool_size: int) -> float:
    """max(total work / pool, longest single item): no plan finishes earlier."""
    k = np.asarray(ring_sizes)
    work = np.where(k > 1, np.asarray(ring_cost) * k, np.asarray(local_cost))
    longest = float(np.max(np.where(k > 1, ring_cost, local_cost)))
    return max(float(work.sum()) / pool_size, longest)


def rank_count(s: int, capacity: int) -> int:
    """Ranks a sequence needs without offloading."""
    return max(1, math.ceil(s / capacity))
