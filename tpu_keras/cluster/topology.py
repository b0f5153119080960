"""What each TPU generation and slice offers, from Google's public Cloud TPU pages.

MFU needs the published peak FLOP/s of the chips a run is on, memory planning
needs HBM per device, and launching needs to know how many hosts (TPU VMs, one
process each) a slice name such as `v4-32` stands for. TPU names are easy to
misread: the number after the dash counts TensorCores on v2, v3, v4 and v5p but
chips on v5e and v6e, and a v4 (or v5p) chip has 2 TensorCores presented as
ONE device (megacore), not 4 cores as is sometimes said (docs/design.md).
Importing this module must stay cheap: standard library only, no TensorFlow.
"""

import dataclasses
import functools
import math
import re
from typing import Optional, Tuple

from tpu_keras.errors import UserError, closest

GiB = 2 ** 30
TERA = 10 ** 12


@dataclasses.dataclass(frozen=True)
class Generation:
    """Per-chip figures of one TPU generation; every number is per CHIP unless named per device."""

    name: str                          # 'v5e'
    prefix: str                        # what gcloud writes before the dash: 'v5litepod'
    aliases: Tuple[str, ...]           # other prefixes users write: 'v5e'
    tensorcores_per_chip: int
    devices_per_chip: int              # TF/JAX devices: 1 on megacore chips (v4, v5p)
    chips_per_host: int                # chips per TPU VM (one process) in a multi-host slice
    max_single_host_chips: int         # the largest slice that is one VM
    hbm_bytes_per_chip: int            # usable: what the devices report (see GENERATIONS)
    peak_bf16_flops_per_chip: float
    pod_chips: int                     # chips in a whole pod
    max_slice_chips: int               # the largest single slice Cloud TPU offers
    name_counts: str                   # what the number in 'v4-32' counts: 'TensorCores' or 'chips'
    sizes: Tuple[int, ...] = ()        # documented slice numbers; () = those `chip_shape` fits
    device_kinds: Tuple[str, ...] = ()  # jax `device_kind` / TF names, lower case, without 'TPU '
    torus_dims: int = 2                # the chip interconnect's dimensions: 3 on v4 and v5p
    # The networks (see NETWORKS below): published bidirectional chip-interconnect (ICI)
    # bandwidth per chip, and data-center-network (DCN) bandwidth per chip, in Gbit/s.
    # None: no figure, and no multislice (v2 and v3).
    ici_gbps_per_chip: Optional[float] = None
    dcn_gbps_per_chip: Optional[float] = None

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.hbm_bytes_per_chip // self.devices_per_chip

    @property
    def peak_flops_per_device(self) -> float:
        """Peak bf16 FLOP/s of one TF/JAX device (half a chip on v2/v3, a whole chip elsewhere)."""
        return self.peak_bf16_flops_per_chip / self.devices_per_chip

    @property
    def name_units_per_chip(self) -> int:
        """How much one chip adds to the number in a slice name (2 for 'v4-8' = 4 chips)."""
        return self.tensorcores_per_chip if self.name_counts == "TensorCores" else 1


# HBM is the usable bytes the devices report: the runtime's allocation limit
# (jax `Device.memory_stats()["bytes_limit"]`), which XLA's out-of-memory
# message prints as "Used X of <limit> hbm", rounded to 0.01 GiB. It is below
# the published capacity on most generations, and a memory plan against the
# published figure would promise memory that is not there. Where only XLA's
# message was found, the figure is its rounded GiB.
GENERATIONS = {g.name: g for g in (
    # https://cloud.google.com/tpu/docs/v2 and /system-architecture-tpu-vm: 2 TensorCores per
    # chip, each its own device; 8 GiB HBM per TensorCore, of which a v2-8 device has "7.48G"
    # (https://github.com/erfanzar/EasyDeL/issues/78); 4 chips per host (v2-8 is one host).
    # 45 TFLOP/s bf16 per chip = 180 per 4-chip board (Google's launch figure; Jouppi et al.,
    # CACM 2020, linked from the v2 page, lists 46). Largest type v2-512 = 512 TensorCores
    # = 256 chips (the v2 page's "512 chips" counts TensorCores).
    Generation("v2", "v2", (), tensorcores_per_chip=2, devices_per_chip=2, chips_per_host=4,
               max_single_host_chips=4, hbm_bytes_per_chip=2 * round(7.48 * GiB),
               peak_bf16_flops_per_chip=45 * TERA, pod_chips=256, max_slice_chips=256,
               name_counts="TensorCores", sizes=(8, 32, 128, 256, 512),  # types the v2 page lists
               device_kinds=("v2",)),
    # https://cloud.google.com/tpu/docs/v3: 2 TensorCores per chip (each its own device);
    # "123 teraflops (bf16)" and "32 GiB" HBM2 per chip (16 GiB per TensorCore, of which a
    # v3-8 device has "15.48G": https://github.com/LargeWorldModel/LWM/issues/60); pod 1024
    # chips = v3-2048; 4 chips per host (/system-architecture-tpu-vm).
    Generation("v3", "v3", (), tensorcores_per_chip=2, devices_per_chip=2, chips_per_host=4,
               max_single_host_chips=4, hbm_bytes_per_chip=2 * round(15.48 * GiB),
               peak_bf16_flops_per_chip=123 * TERA, pod_chips=1024, max_slice_chips=1024,
               name_counts="TensorCores", sizes=(8, 32, 64, 128, 256, 512, 1024, 2048),
               device_kinds=("v3",)),
    # https://cloud.google.com/tpu/docs/v4: 2 TensorCores per chip presented as one device
    # (megacore); "275 teraflops (bf16 or int8)" and "32 GiB" HBM2 per chip; "TPU Pod size 4096
    # chips"; 4 chips per host. HBM: bytes_limit 33,014,415,360 B = 30.75 GiB
    # (https://github.com/jax-ml/jax/issues/1491, June 2023, when v4 was the only TPU with
    # 32 GiB per device; "of 30.75G hbm" on a v4-256,
    # https://github.com/young-geng/EasyLM/issues/98).
    # A later runtime reported 34,088,157,184 B (https://github.com/pytorch/xla/pull/7086);
    # the lower figure is kept. Largest slice: v4-4096 = 8x16x16 = 2048 chips, the largest v4
    # topology in Google's https://github.com/AI-Hypercomputer/xpk
    # src/xpk/core/system_characteristics.py; no list of v4 slice types found goes further (the
    # 4096-chip pod is not offered as one slice; the v4 page's 12x12x24 illustrates its torus
    # rule and is not a listed type).
    Generation("v4", "v4", (), tensorcores_per_chip=2, devices_per_chip=1, chips_per_host=4,
               max_single_host_chips=4, hbm_bytes_per_chip=33_014_415_360,
               peak_bf16_flops_per_chip=275 * TERA, pod_chips=4096, max_slice_chips=2048,
               name_counts="TensorCores", device_kinds=("v4",), torus_dims=3),
    # https://cloud.google.com/tpu/docs/v5e: 1 TensorCore per chip; "197 TFLOPs" bf16 and
    # "16 GB" HBM2 per chip, of which a device has 15.75 GiB: the limit XLA's out-of-memory
    # messages give on v5litepod-1 and v5e-8 in public logs ("Used X of 15.75G hbm"); no exact
    # bytes_limit of a v5e was found. Pod 256 chips. A v5e machine holds 8 chips ("Chips per
    # host: 8"), but only v5litepod-1/-4/-8 are one VM; multi-host slices are 4-chip VMs
    # (ct5lp-hightpu-4t), so v5litepod-16 has 4 workers (the page's "Number of hosts: 2" counts
    # 8-chip machines; see the v6e page's VMs column, and
    # https://github.com/AI-Hypercomputer/xpk src/xpk/core/system_characteristics.py).
    Generation("v5e", "v5litepod", ("v5e", "v5lite"), tensorcores_per_chip=1, devices_per_chip=1,
               chips_per_host=4, max_single_host_chips=8, hbm_bytes_per_chip=round(15.75 * GiB),
               peak_bf16_flops_per_chip=197 * TERA, pod_chips=256, max_slice_chips=256,
               name_counts="chips", sizes=(1, 4, 8, 16, 32, 64, 128, 256),
               device_kinds=("v5 lite", "v5lite", "v5e", "v5litepod")),
    # https://cloud.google.com/tpu/docs/v5p: "Number of TensorCores per chip 2" (one megacore
    # device, like v4); "459" TFLOP/s bf16 and "95" GiB HBM per chip, of which a device reports
    # 102,803,439,616 B = 95.74 GiB (the v5p-8 case of Google's tpu-info,
    # https://github.com/AI-Hypercomputer/cloud-accelerator-diagnostics tpu_info/metrics_test.py;
    # XLA's limit on a v5p-64 is "95.74G" as well); 8960 chips per pod, but "the maximum v5p
    # shape is 16x16x24 (6144 chips)" = v5p-12288; 4-chip VMs.
    Generation("v5p", "v5p", (), tensorcores_per_chip=2, devices_per_chip=1, chips_per_host=4,
               max_single_host_chips=4, hbm_bytes_per_chip=102_803_439_616,
               peak_bf16_flops_per_chip=459 * TERA, pod_chips=8960, max_slice_chips=6144,
               name_counts="TensorCores", device_kinds=("v5", "v5p"), torus_dims=3),
    # https://cloud.google.com/tpu/docs/v6e (Trillium): 1 TensorCore per chip; "918 TFLOPs" bf16
    # and "32 GB" HBM per chip, of which a device reports 33,550,237,696 B = 31.25 GiB
    # ("gpu_memory_per_device" on a v6e: https://github.com/vllm-project/vllm/pull/16211);
    # pod 256 chips. Supported-configurations table: v6e-1/-4/-8 are one VM; multi-host slices
    # have 2 VMs of 4 chips per 8-chip host, e.g. 4x4 = 16 chips, 2 hosts, 4 VMs.
    Generation("v6e", "v6e", ("trillium",), tensorcores_per_chip=1, devices_per_chip=1,
               chips_per_host=4, max_single_host_chips=8, hbm_bytes_per_chip=33_550_237_696,
               peak_bf16_flops_per_chip=918 * TERA, pod_chips=256, max_slice_chips=256,
               name_counts="chips", sizes=(1, 4, 8, 16, 32, 64, 128, 256),
               device_kinds=("v6 lite", "v6lite", "v6e", "trillium")),
)}
# Newer generations (e.g. Ironwood, tpu7x) are left out until their per-device figures are
# published in the same form.

# The networks, for the planner's communication time (`tools.network`). ICI: the
# "Interchip Interconnect BW" / "Bidirectional inter-chip interconnect (ICI) bandwidth"
# row of each generation's page, both directions of every link of one chip together.
# DCN: what the host's network cards give each chip, from the same pages. Multislice is
# offered on v4 and later only (https://cloud.google.com/tpu/docs/multislice-introduction:
# "Multislice is only supported on Cloud TPU v4 and later").
NETWORKS = {
    # v4: ASSUMED. No v4 figures in this form were found in the pages checked: 2,400 Gbit/s
    # ICI per chip is the figure often quoted for v4 (not verified here), and the DCN figure
    # is v5e's 25 Gbit/s per chip.
    "v4": (2400, 25),
    # https://cloud.google.com/tpu/docs/v5e: "Interchip Interconnect BW 1600 Gbps";
    # "Data center network bandwidth per Pod 6.4 Tbps" over 256 chips = 25 Gbit/s per chip
    # (the v6e page's comparison: "Per-host NIC configuration 2 x 100 Gbps NIC" per 8 chips).
    "v5e": (1600, 25),
    # https://cloud.google.com/tpu/docs/v5p: "Bidirectional inter-chip interconnect (ICI)
    # bandwidth per chip (GBps) 1200" (= 4800 Gbit/s, the older page's "Interchip
    # Interconnect BW 4800 Gbps"); "Data center network (DCN) bandwidth per chip (Gbps) 50".
    "v5p": (4800, 50),
    # https://cloud.google.com/tpu/docs/v6e: "Inter-chip interconnect (ICI) bandwidth 3200 Gbps"
    # (an earlier version of the page said 3584); "Per-host NIC configuration 4 x 200 Gbps
    # NIC" per 8 chips and "Data center network bandwidth per Pod 25.6 Tbps" over 256 chips:
    # 100 Gbit/s per chip.
    "v6e": (3200, 100),
}
GENERATIONS = {name: dataclasses.replace(g, **dict(zip(("ici_gbps_per_chip", "dcn_gbps_per_chip"),
                                                        NETWORKS.get(name, (None, None)))))
               for name, g in GENERATIONS.items()}

_BY_PREFIX = {p: g for g in GENERATIONS.values() for p in (g.prefix, *g.aliases)}
_BY_DEVICE_KIND = {k: g for g in GENERATIONS.values() for k in g.device_kinds}


@dataclasses.dataclass(frozen=True)
class Slice:
    """A slice such as `v4-32`: hosts are TPU VMs (workers), each running one process."""

    name: str  # canonical accelerator type, e.g. 'v5litepod-16' for 'v5e-16'
    generation: Generation
    chips: int

    @property
    def hosts(self) -> int:
        gen = self.generation
        return 1 if self.chips <= gen.max_single_host_chips else self.chips // gen.chips_per_host

    @property
    def chips_per_host(self) -> int:
        return self.chips // self.hosts

    @property
    def tensorcores(self) -> int:
        return self.chips * self.generation.tensorcores_per_chip

    @property
    def devices(self) -> int:
        return self.chips * self.generation.devices_per_chip

    @property
    def devices_per_host(self) -> int:
        return self.devices // self.hosts

    @property
    def hbm_bytes_per_device(self) -> int:
        return self.generation.hbm_bytes_per_device

    @property
    def peak_flops_per_device(self) -> float:
        return self.generation.peak_flops_per_device

    @property
    def peak_flops(self) -> float:
        """Peak bf16 FLOP/s of the whole slice."""
        return self.devices * self.peak_flops_per_device

    @property
    def chip_shape(self) -> Tuple[int, ...]:
        """The slice's chips as the interconnect joins them: (x, y) on v2, v3, v5e and v6e,
        (x, y, z) on v4 and v5p (`chip_shape`)."""
        return chip_shape(self.chips, self.generation.torus_dims)

    @property
    def topology_name(self) -> str:
        """How the TPU runtime (libtpu) names the slice's shape: 'v5e:4x4', 'v4:2x2x4'."""
        runtime_name = {"v5p": "v5"}.get(self.generation.name, self.generation.name)
        return f"{runtime_name}:{'x'.join(map(str, self.chip_shape))}"

    @property
    def wraparound(self) -> Tuple[bool, ...]:
        """Which sides of `chip_shape` close into a ring: every side of a v4 or v5p slice of
        64 chips or more (4x4x4 and up), and on the 2-D generations a side as long as the
        pod's (16 chips on v5e and v6e), as Google's table of TPU types gives them
        (https://github.com/AI-Hypercomputer/xpk src/xpk/core/system_characteristics.py)."""
        if self.generation.torus_dims == 3:
            return (self.chips >= 64,) * 3
        pod_side = math.isqrt(self.generation.pod_chips)
        return tuple(side == pod_side for side in self.chip_shape)

    @property
    def host_shape(self) -> Tuple[int, int, int]:
        """The chips one host (TPU VM) holds, as a block of `chip_shape`: (2, 2, 1) on every
        multi-host slice; the whole slice on one host."""
        if self.hosts == 1:
            return tuple(self.chip_shape) + (1,) * (3 - len(self.chip_shape))
        return (2, 2, 1)


@functools.lru_cache(maxsize=None)
def chip_shape(chips: int, dims: int) -> Optional[Tuple[int, ...]]:
    """The shape of a slice of `chips` chips on a `dims`-dimensional interconnect, or None
    where no slice of that size exists.

    Cloud TPU writes a slice's topology as AxBxC (v4, v5p) or AxB (v5e, v6e)
    with every side at most 4 or every side a multiple of 4
    (https://cloud.google.com/tpu/docs/types-topologies), and a slice of 4
    chips or more is whole 2x2 blocks of chips (a multi-host slice's hosts),
    so its first two sides are even. Of the shapes that fit, this takes the
    most cube-like, smaller sides first: the published types (v4-32 = 2x2x4,
    v4-384 = 4x4x12, v5p-1280 = 4x8x20, v5litepod-16 = 4x4, v5litepod-128 =
    8x16).
    """
    def shapes(remaining, sides):
        if sides == 1:
            yield (remaining,)
            return
        for side in range(1, remaining + 1):
            if remaining % side == 0:
                for rest in shapes(remaining // side, sides - 1):
                    yield (side,) + rest

    fitting = [shape for shape in shapes(chips, dims)
               if (chips < 4 or (shape[0] % 2 == 0 and shape[1] % 2 == 0))
               and (all(side <= 4 for side in shape) or all(side % 4 == 0 for side in shape))]
    if not fitting:
        return None
    return min(fitting, key=lambda s: (max(s) / min(s), tuple(sorted(s)) != s, s))


def parse_slice(name: str) -> Slice:
    """The slice an accelerator type names ('v4-32', 'v5litepod-16', 'v5e-16', 'v6e-256').

    Raises a one-line `UserError` for an unknown generation or a size that
    generation does not come in.
    """
    text = str(name).strip().lower()
    match = re.fullmatch(r"(v\w+?)-(\d+)", text)
    gen = _BY_PREFIX.get(match.group(1)) if match else None
    if gen is None:
        number = match.group(2) if match else "8"
        unknown_version = bool(match) and re.fullmatch(r"v\d+", match.group(1))  # 'v9': no typo
        candidates = [] if unknown_version else [f"{p}-{number}" for p in _BY_PREFIX]
        suggestion = closest(text, candidates)
        raise UserError(f"unknown TPU slice {name!r}{suggestion}: write <generation>-<size> "
                        f"like v4-32 or v5litepod-16, with a generation of {_generation_list()}")
    number = int(match.group(2))
    unit = gen.name_units_per_chip
    largest = gen.max_slice_chips * unit
    if gen.sizes:
        valid = number in gen.sizes
        allowed = ", ".join(f"{gen.prefix}-{n}" for n in gen.sizes)
    else:  # v4, v5p: the sizes whose chips form a slice (`chip_shape`)
        step = gen.chips_per_host * unit
        valid = (number % step == 0 and 0 < number <= largest
                 and chip_shape(number // unit, gen.torus_dims) is not None)
    if not valid and not gen.sizes:
        first = [n for n in range(step, 128 * unit + 1, step)
                 if chip_shape(n // unit, gen.torus_dims)]
        allowed = (f"{', '.join(f'{gen.prefix}-{n}' for n in first)}, or a larger one up to "
                   f"{gen.prefix}-{largest} whose chips form AxBxC with each side a multiple of 4")
    if not valid:
        if number > largest:
            raise UserError(f"TPU slice {name!r} does not exist: the largest {gen.name} slice "
                            f"is {gen.prefix}-{largest} ({gen.max_slice_chips} chips); "
                            f"write {allowed}")
        per_chip = (f", {gen.tensorcores_per_chip} per chip" if gen.name_counts == "TensorCores"
                    else "")
        raise UserError(f"TPU slice {name!r} does not exist: the number after '{match.group(1)}-' "
                        f"counts {gen.name_counts}{per_chip}; write {allowed}")
    return Slice(f"{gen.prefix}-{number}", gen, number // unit)


def parse_tpu(name: str) -> Tuple[int, Slice]:
    """(slices, slice) for a TPU type, with multislice written `<count>x<type>`: '2xv5litepod-256'
    is two v5litepod-256 slices joined by the data-center network; 'v4-32' is one slice.

    Raises a one-line `UserError` for a count below 1, or more than one slice of a
    generation that Cloud TPU does not offer as multislice (v2, v3).
    """
    text = str(name).strip().lower()
    match = re.fullmatch(r"(\d+)\s*x\s*(v.+)", text)
    if not match:
        return 1, parse_slice(name)
    count, one = int(match.group(1)), parse_slice(match.group(2))
    if count < 1:
        raise UserError(f"TPU type {name!r} names {count} slices; write <count>x<type> with a "
                        f"count of 1 or more, e.g. 2x{one.name}")
    if count > 1 and one.generation.dcn_gbps_per_chip is None:
        multislice = ", ".join(g.name for g in GENERATIONS.values() if g.dcn_gbps_per_chip)
        raise UserError(f"TPU type {name!r}: Cloud TPU offers multislice on {multislice} only, "
                        f"not on {one.generation.name}; use one slice ({one.name} or larger)")
    return count, one


def generation_of_device_kind(kind: str) -> Optional[Generation]:
    """The generation of a device kind such as 'TPU v4', 'TPU v5 lite', '8 x TPU v6e' or
    'TPU v5litepod-16'; None when it is not a TPU generation in the table."""
    text = re.sub(r"^\d+\s*x\s*", "", str(kind).strip().lower())  # Cluster.device_kind: '8 x ...'
    text = re.sub(r"^(cloud\s+)?tpu[\s_-]*", "", text)
    text = re.sub(r"-\d+$", "", text)  # an accelerator type: 'v4-32'
    text = " ".join(text.split())
    return _BY_DEVICE_KIND.get(text) or _BY_PREFIX.get(text)


def _generation_list() -> str:
    return ", ".join(f"{g.prefix} ({g.name})" if g.prefix != g.name else g.name
                     for g in GENERATIONS.values())
