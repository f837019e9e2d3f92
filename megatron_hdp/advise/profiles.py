"""GPU profiles of the advisor: named ones from published datasheets, or a JSON file (pure).

A profile holds per-GPU constants; `GpuProfile.cluster()` turns it into the simulator's
`sim.clusters.Cluster`, whose `rank_profile(tp)` is what the cost model prices with (see
`sim/clusters.py` for how a replica of TP x PP GPUs is scaled).

JSON profiles (`--profile FILE.json`; what `scripts/gpu/verify.py` should write to
results/gpu/) are one object with these fields, SI units (bytes, bytes/s, FLOP/s, s):

=====================  ==========================================================  ==========
field                  meaning                                                     priced by
=====================  ==========================================================  ==========
name                   label in the report (default: the file name)                -
base                   a named profile the missing fields come from (optional)     -
notes                  free text kept in the report (optional)                     -
peak_bf16_flops        dense bf16 tensor FLOP/s per GPU                            compute
linear_efficiency      sustained share of the peak in GEMMs, in (0, 1]             compute
attention_efficiency   sustained share of the peak in attention, in (0, 1]         compute
tp_efficiency          FLOP/s kept per GPU with TP > 1 (exposed TP comm), (0, 1]   compute
hbm_bytes              device memory per GPU                                       memory
hbm_bandwidth          device memory bandwidth per GPU                             reported
nvlink_bandwidth       NVLink bytes/s per GPU, one direction                       reported
gpus_per_node          GPUs on one NVLink domain (TP must fit in it)               layout
network_bandwidth      inter-node bytes/s per GPU, one direction (its NIC)         ring, sync
network_latency        seconds per inter-node message                              ring, sync
host_link_bandwidth    device <-> host bytes/s per GPU, one direction              offload
host_memory_per_gpu    host bytes one GPU may fill with offloaded activations      offload
=====================  ==========================================================  ==========

"reported" fields are part of the profile and the report, but the cost model has no term
for them: GEMM and attention speeds are FLOP/s times an efficiency, TP all-reduces are the
`tp_efficiency` factor (`cost.DeviceProfile.replica`). A calibrated profile should measure
the efficiencies (achieved FLOP/s over `peak_bf16_flops`), the network and the host link.

Without `base` every field but `name`, `notes` and the three efficiencies (default: the
named profiles') is required. Unknown fields, values that are not finite positive numbers,
efficiencies above 1 and a fractional `gpus_per_node` are refused by name.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from megatron_hdp.sim.clusters import Cluster

#: Efficiencies shared by every named profile: the values of `cost.H100` (typical Megatron
#: GEMM MFU, FlashAttention-2 forward + backward) and `sim.clusters` (TP comm partly
#: exposed). A stated choice, not fitted per GPU: calibrate with a JSON profile.
_LINEAR_EFFICIENCY = 0.6
_ATTENTION_EFFICIENCY = 0.4
_TP_EFFICIENCY = 0.9


@dataclass(frozen=True, kw_only=True)
class GpuProfile:
    """Per-GPU constants of a cluster (field meanings: the module docstring's table)."""

    name: str
    peak_bf16_flops: float
    hbm_bytes: float
    hbm_bandwidth: float
    nvlink_bandwidth: float
    gpus_per_node: int
    network_bandwidth: float
    network_latency: float
    host_link_bandwidth: float
    host_memory_per_gpu: float
    linear_efficiency: float = _LINEAR_EFFICIENCY
    attention_efficiency: float = _ATTENTION_EFFICIENCY
    tp_efficiency: float = _TP_EFFICIENCY
    notes: str = ""

    def cluster(self) -> Cluster:
        """The simulator's cluster of this GPU (what the cost model is built from)."""
        return Cluster(
            name=self.name,
            peak_flops=self.peak_bf16_flops,
            linear_efficiency=self.linear_efficiency,
            attention_efficiency=self.attention_efficiency,
            gpus_per_node=self.gpus_per_node,
            nvlink_bandwidth=self.nvlink_bandwidth,
            ib_bandwidth=self.network_bandwidth,
            ib_latency=self.network_latency,
            host_bandwidth=self.host_link_bandwidth,
            gpu_memory=self.hbm_bytes,
            host_memory_per_gpu=self.host_memory_per_gpu,
            tp_efficiency=self.tp_efficiency,
        )

    def as_dict(self) -> dict:
        """JSON-ready fields (loadable again with `profile_from_dict`)."""
        return asdict(self)


# Host links: PCIe Gen4 x16 is 32 GB/s per direction (64 GB/s bidirectional in the A100
# datasheet), Gen5 x16 64 GB/s (128 GB/s in the H100/H200 datasheets); we take ~80% of
# that as the effective copy rate, as `cost.H100` (50 GB/s) and `cost.A100` (25 GB/s) do.
# Host memory for offloading: half of a GPU's share of the node's DIMMs (`cost.H100`).
# Network latency: ~10 us per message on InfiniBand (`cost.H100`), a stated choice.

#: NVIDIA A100 80GB SXM. A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4):
#: BF16 tensor 312 TFLOP/s dense (624 with sparsity), 80 GB HBM2e at 2,039 GB/s, NVLink
#: 600 GB/s (bidirectional: 300 per direction), PCIe Gen4 64 GB/s. DGX A100 640GB
#: datasheet: 8 single-port ConnectX-6 200 Gb/s HDR InfiniBand (25 GB/s per GPU, per
#: direction), 2 TB system memory (256 GB per GPU, half = 128 GB for offloading).
A100_80G = GpuProfile(
    name="A100-80G",
    peak_bf16_flops=312e12,
    hbm_bytes=80e9,
    hbm_bandwidth=2039e9,
    nvlink_bandwidth=300e9,
    gpus_per_node=8,
    network_bandwidth=25e9,
    network_latency=10e-6,
    host_link_bandwidth=25e9,
    host_memory_per_gpu=128e9,
)
#: NVIDIA H100 SXM5. H100 datasheet: BF16 tensor 1,979 TFLOP/s with sparsity = 989 dense,
#: 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s (450 per direction), PCIe Gen5 128 GB/s.
#: DGX H100 datasheet: 8 single-port ConnectX-7 400 Gb/s NDR (50 GB/s per GPU, per
#: direction), 2 TB system memory (128 GB per GPU for offloading). The same constants as
#: the simulator's `sim.clusters.H100_CLUSTER`, so the advisor reproduces its numbers.
H100 = GpuProfile(
    name="H100",
    peak_bf16_flops=989e12,
    hbm_bytes=80e9,
    hbm_bandwidth=3.35e12,
    nvlink_bandwidth=450e9,
    gpus_per_node=8,
    network_bandwidth=50e9,
    network_latency=10e-6,
    host_link_bandwidth=50e9,
    host_memory_per_gpu=128e9,
)
#: NVIDIA H200 SXM. H200 datasheet: BF16 tensor 1,979 TFLOP/s with sparsity = 989 dense
#: (the H100's compute), 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s (450 per direction),
#: PCIe Gen5 128 GB/s. DGX H200 datasheet: 8 single-port ConnectX-7 400 Gb/s (50 GB/s per
#: GPU, per direction), 2 TB system memory (128 GB per GPU for offloading).
H200 = GpuProfile(
    name="H200",
    peak_bf16_flops=989e12,
    hbm_bytes=141e9,
    hbm_bandwidth=4.8e12,
    nvlink_bandwidth=450e9,
    gpus_per_node=8,
    network_bandwidth=50e9,
    network_latency=10e-6,
    host_link_bandwidth=50e9,
    host_memory_per_gpu=128e9,
)
#: NVIDIA B200 (HGX/DGX B200, 1,000 W). HGX B200 datasheet: FP16/BF16 tensor 4.5 PFLOP/s
#: per GPU with sparsity = 2.25 PFLOP/s dense; DGX B200 datasheet: 1,440 GB HBM3e for 8
#: GPUs (180 GB each) at 64 TB/s (8 TB/s each), NVLink 5 1.8 TB/s per GPU (900 GB/s per
#: direction), 8 single-port ConnectX-7 400 Gb/s (50 GB/s per GPU, per direction), two
#: PCIe Gen5 Xeon 8570 hosts, 2 TB system memory (128 GB per GPU for offloading). The
#: efficiencies are the Hopper values, unmeasured on Blackwell: calibrate before trusting.
B200 = GpuProfile(
    name="B200",
    peak_bf16_flops=2.25e15,
    hbm_bytes=180e9,
    hbm_bandwidth=8e12,
    nvlink_bandwidth=900e9,
    gpus_per_node=8,
    network_bandwidth=50e9,
    network_latency=10e-6,
    host_link_bandwidth=50e9,
    host_memory_per_gpu=128e9,
)

PROFILES: dict[str, GpuProfile] = {p.name: p for p in (A100_80G, H100, H200, B200)}

_TEXT_FIELDS = ("name", "notes")
_EFFICIENCIES = ("linear_efficiency", "attention_efficiency", "tp_efficiency")
FIELDS = tuple(f.name for f in fields(GpuProfile))
NUMBER_FIELDS = tuple(f for f in FIELDS if f not in _TEXT_FIELDS)


def named_profile(name: str) -> GpuProfile | None:
    """The named profile (case-insensitive), or None."""
    for key, profile in PROFILES.items():
        if key.lower() == name.lower():
            return profile
    return None


def _number(origin: str, key: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{origin}: field {key!r} = {value!r} is not a number")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{origin}: field {key!r} = {value!r} must be finite and > 0")
    if key in _EFFICIENCIES and value > 1:
        raise ValueError(f"{origin}: field {key!r} = {value!r} is an efficiency, in (0, 1]")
    if key == "gpus_per_node":
        if value != int(value):
            raise ValueError(f"{origin}: field 'gpus_per_node' = {value!r} is not a whole number")
        return int(value)
    return float(value)


def profile_from_dict(
    data, *, origin: str = "<profile>", default_name: str = "custom"
) -> GpuProfile:
    """A profile from a JSON object (see the module docstring); ValueError naming the field."""
    if not isinstance(data, dict):
        raise ValueError(f"{origin}: a profile is a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - set(FIELDS) - {"base"})
    if unknown:
        raise ValueError(
            f"{origin}: unknown field {unknown[0]!r} (fields: {', '.join(('base', *FIELDS))})"
        )
    base = None
    if "base" in data:
        base = named_profile(str(data["base"]))
        if base is None:
            raise ValueError(
                f"{origin}: field 'base' = {data['base']!r} is not a profile name "
                f"({', '.join(PROFILES)})"
            )
    values = {k: _number(origin, k, v) for k, v in data.items() if k in NUMBER_FIELDS}
    for key in _TEXT_FIELDS:
        if key in data and not isinstance(data[key], str):
            raise ValueError(f"{origin}: field {key!r} = {data[key]!r} is not a string")
    name = data.get("name") or (f"{base.name}+{default_name}" if base else default_name)
    if base is not None:
        return replace(base, **values, name=name, notes=data.get("notes", ""))
    required = [
        f.name
        for f in fields(GpuProfile)
        if f.name in NUMBER_FIELDS and f.name not in values and f.name not in _EFFICIENCIES
    ]
    if required:
        raise ValueError(
            f"{origin}: missing field {required[0]!r} (give every field, or 'base': a "
            f"profile name to take the others from)"
        )
    return GpuProfile(**values, name=name, notes=data.get("notes", ""))


def load_profile(path: str | Path) -> GpuProfile:
    """A profile from a JSON file; ValueError naming the file and the bad field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as err:
        raise ValueError(f"--profile {path}: cannot read ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"--profile {path}: not JSON ({err})") from None
    return profile_from_dict(data, origin=f"--profile {path}", default_name=path.stem)


def resolve_profile(spec: str) -> GpuProfile:
    """`--profile`: a name (A100-80G, H100, H200, B200) or a JSON file."""
    named = named_profile(spec)
    if named is not None:
        return named
    if spec.endswith(".json") or Path(spec).is_file():
        if not Path(spec).is_file():
            raise ValueError(f"--profile {spec}: no such file")
        return load_profile(spec)
    raise ValueError(
        f"--profile {spec}: neither a profile name ({', '.join(PROFILES)}) nor a JSON file"
    )
