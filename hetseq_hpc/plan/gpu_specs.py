"""NVIDIA GPUs from their specifications: SM count, boost clock, compute capability, memory and
memory bandwidth, and from these the peak FLOP/s per precision.

Peak = SMs x FLOP per SM per clock (by architecture, :data:`ARCHS`) x clock
(:func:`peak_flops`); a probed GPU in no table still gets a peak (:func:`spec_from_probe`).
The assumptions (tensor-core rates with FP32 accumulate, GeForce halving, Volta/Turing bf16,
Pascal fp16, TF32 unused by the runtime, Hopper's tensor clock) are stated once:
docs/design/planner.md, "GPU specifications and peak FLOP/s".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from hetseq_hpc.errors import ConfigError

#: precisions a peak can be asked for
PEAK_PRECISIONS = ("fp32", "tf32", "fp16", "bf16")


@dataclass(frozen=True)
class Arch:
    """FLOP per SM per clock of one architecture (compute capability), dense, no sparsity.

    Attributes:
        name: architecture name.
        fp32_lanes: fp32 FMA lanes per SM (x2 FLOP per FMA).
        tensor: fp16/bf16 tensor FLOP per SM per clock with fp32 accumulate, full-rate parts
            (0 = no tensor cores).
        tf32: TF32 tensor FLOP per SM per clock (0 = none).
        half_vs_fp32: rate of fp16 training (fp16 storage, fp32 accumulate) over fp32
            without tensor cores (Pascal): 1.0, its arithmetic is fp32.
        half_native: native fp16 arithmetic (fp16 accumulate) over fp32 without tensor cores,
            the datasheet's figure (2.0 GP100, 1/64 GP102); documentation only, nothing the
            runtime runs uses it.
        bf16: whether the tensor cores run bf16.
    """

    name: str
    fp32_lanes: int
    tensor: int = 0
    tf32: int = 0
    half_vs_fp32: float = 1.0
    bf16: bool = False
    half_native: float = 0.0


#: compute capability -> architecture (Pascal .. Hopper whitepapers' per-SM rates)
ARCHS: Dict[Tuple[int, int], Arch] = {
    (6, 0): Arch("Pascal GP100", 64, half_vs_fp32=1.0, half_native=2.0),
    (6, 1): Arch("Pascal GP10x", 128, half_vs_fp32=1.0, half_native=1.0 / 64),
    (7, 0): Arch("Volta", 64, tensor=1024),
    (7, 5): Arch("Turing", 64, tensor=1024),
    (8, 0): Arch("Ampere GA100", 64, tensor=2048, tf32=1024, bf16=True),
    (8, 6): Arch("Ampere GA10x", 128, tensor=1024, tf32=512, bf16=True),
    (8, 9): Arch("Ada", 128, tensor=1024, tf32=512, bf16=True),
    (9, 0): Arch("Hopper", 128, tensor=4096, tf32=2048, bf16=True),
}


def arch_for(capability: Tuple[int, int]) -> Arch:
    """The architecture of ``capability``: its own row, else the newest row not newer than it
    (a future GPU is rated as the newest known one).

    Raises:
        ConfigError: the capability is older than Pascal (6.0).
    """
    cap = (int(capability[0]), int(capability[1]))
    if cap in ARCHS:
        return ARCHS[cap]
    older = [c for c in ARCHS if c <= cap]
    if not older:
        raise ConfigError(
            f"compute capability {cap[0]}.{cap[1]} is older than Pascal (6.0), "
            "which the planner has no rates for: measure it with plan.probe="
        )
    return ARCHS[max(older)]


def peak_flops(
    capability: Tuple[int, int],
    sm_count: int,
    clock_mhz: float,
    precision: str,
    geforce: bool = False,
    tensor_mhz: Optional[float] = None,
) -> float:
    """Peak FLOP/s from the facts the probe reads.

    Args:
        capability: CUDA compute capability ``(major, minor)``.
        sm_count: streaming multiprocessors.
        clock_mhz: boost (maximum SM) clock, MHz.
        precision: ``fp32``, ``tf32``, ``fp16`` or ``bf16``.
        geforce: a GeForce part (half-rate tensor with fp32 accumulate, half-rate TF32).
        tensor_mhz: the clock the vendor's tensor peak is quoted at, if lower (Hopper).

    Returns:
        FLOP/s; for ``tf32`` on a GPU without TF32, the fp32 peak (that is what runs).

    Raises:
        ConfigError: unknown precision, or a capability older than Pascal.
    """
    if precision not in PEAK_PRECISIONS:
        raise ConfigError(
            f"precision {precision!r} has no peak: use one of {', '.join(PEAK_PRECISIONS)}"
        )
    arch = arch_for(capability)
    fp32 = sm_count * arch.fp32_lanes * 2 * clock_mhz * 1e6
    tensor_clock = (tensor_mhz or clock_mhz) * 1e6
    rate = 0.5 if geforce else 1.0
    if precision == "fp32" or (precision == "tf32" and not arch.tf32):
        return fp32
    if precision == "tf32":
        return sm_count * arch.tf32 * tensor_clock * rate
    if not arch.tensor:
        return fp32 * arch.half_vs_fp32
    return sm_count * arch.tensor * tensor_clock * rate


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model from its datasheet / whitepaper.

    Attributes:
        label: display name.
        capability: CUDA compute capability.
        sm_count: streaming multiprocessors.
        boost_mhz: boost clock, MHz.
        memory_gib: memory (the nominal "GB" figure, taken as GiB as nvidia-smi shows it).
        bandwidth_gbs: memory bandwidth, GB/s.
        source: the datasheet or whitepaper the row comes from.
        geforce: GeForce part (half-rate fp32-accumulate tensor and TF32, see module doc).
        tensor_mhz: clock the vendor's tensor peaks are quoted at, when lower than boost.
        gpu_link: the link between the GPUs of one node (:data:`GPU_LINK_GBPS`): ``pcie3``..
            ``pcie5`` (the board's host interface) or ``nvlink1``..``nvlink4`` (SXM parts).
        tdp_w: board power limit, W (datasheet); 0 = not used (:func:`power_clock_factor`).
    """

    label: str
    capability: Tuple[int, int]
    sm_count: int
    boost_mhz: float
    memory_gib: float
    bandwidth_gbs: float
    source: str
    geforce: bool = False
    tensor_mhz: Optional[float] = None
    gpu_link: str = "pcie3"
    tdp_w: float = 0.0

    @property
    def intra_node_gbps(self) -> float:
        """Bandwidth between two GPUs of one node, Gbit/s one way (:data:`GPU_LINK_GBPS`)."""
        return GPU_LINK_GBPS[self.gpu_link]

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s in ``precision`` (:func:`peak_flops` on this row's facts)."""
        return peak_flops(
            self.capability, self.sm_count, self.boost_mhz, precision, self.geforce, self.tensor_mhz
        )

    @property
    def tensor_dtype(self) -> str:
        """``bf16`` where the tensor cores run it (cc >= 8.0), else ``fp16``."""
        return "bf16" if arch_for(self.capability).bf16 else "fp16"


_V100 = "NVIDIA Tesla V100 datasheet + Volta whitepaper (SXM2: 80 SMs, 1530 MHz, 900 GB/s)"
_A100 = "NVIDIA A100 datasheet + whitepaper (108 SMs, 1410 MHz; 1555/2039 GB/s SXM, 1935 PCIe 80GB)"
_TU = "NVIDIA Turing architecture whitepaper, Appendix A"
_GA102 = "NVIDIA Ampere GA102 whitepaper"
_AD = "NVIDIA Ada Lovelace architecture whitepaper"
_H100 = (
    "NVIDIA H100 datasheet + whitepaper (SXM5 132 SMs, 1980 MHz, 3352 GB/s, tensor peaks at "
    "1830 MHz; PCIe 114 SMs, 1755 MHz, 2000 GB/s, tensor peaks at 1620 MHz)"
)


#: link between the GPUs of one node -> Gbit/s one way per GPU: PCIe x16 raw rate (gen3 8 GT/s,
#: gen4 16, gen5 32 per lane, 128b/130b: 15.75 / 31.5 / 63 GB/s; PCI-SIG base specifications),
#: NVLink per GPU (P100 4 links x 20 GB/s, V100 6 x 25, A100 12 x 25, H100 18 x 25 GB/s one way:
#: the Pascal, Volta, Ampere and Hopper whitepapers). PCIe peer traffic through a CPU root port
#: runs slower than this (an upper bound).
GPU_LINK_GBPS: Dict[str, float] = {
    "pcie3": 15.75 * 8,
    "pcie4": 31.5 * 8,
    "pcie5": 63.0 * 8,
    "nvlink1": 80.0 * 8,
    "nvlink2": 150.0 * 8,
    "nvlink3": 300.0 * 8,
    "nvlink4": 450.0 * 8,
}

#: the power-limit reference: the fit source's V100 SXM2 (:mod:`hetseq_hpc.plan.perf_model`),
#: 300 W for 80 SMs at 1530 MHz, taken to hold its boost clock under load
POWER_REFERENCE = (300.0, 80, 1530.0)
#: compute capabilities made on the reference's process (TSMC 12 nm FFN: Volta GV100 and every
#: Turing die), the only ones :func:`power_clock_factor` applies to
POWER_SAME_PROCESS = ((7, 0), (7, 5))


def power_clock_factor(spec: GpuSpec) -> float:
    """Sustained over boost clock of a power-limited GPU, from specifications only, in (0, 1].

    Power at full load is taken as proportional to SMs x clock at the reference's energy per
    SM-cycle (:data:`POWER_REFERENCE`, same process only: :data:`POWER_SAME_PROCESS`); a board
    whose limit ``tdp_w`` is below that need runs at ``boost x (tdp_w / need) ** (1/3)``, the
    textbook DVFS approximation ``P = C V^2 f`` with ``V`` proportional to ``f`` (Weste & Harris,
    CMOS VLSI Design, 4th ed., sec. 5.2). The exponent was set from that approximation, not
    from the held-out figures (docs/planner-accuracy.md gives the alternatives' errors too).
    1.0 without ``tdp_w`` or on another process (no reference there), and for a probed GPU.
    """
    if not spec.tdp_w or tuple(spec.capability) not in POWER_SAME_PROCESS:
        return 1.0
    ref_w, ref_sms, ref_mhz = POWER_REFERENCE
    need = ref_w * spec.sm_count * spec.boost_mhz / (ref_sms * ref_mhz)
    return 1.0 if need <= spec.tdp_w else (spec.tdp_w / need) ** (1.0 / 3.0)


def _row(
    label: str,
    cc: Tuple[int, int],
    sms: int,
    mhz: float,
    gib: float,
    gbs: float,
    source: str,
    geforce: bool = False,
    tensor_mhz: Optional[float] = None,
    link: str = "pcie3",
    tdp_w: float = 0.0,
) -> GpuSpec:
    return GpuSpec(label, cc, sms, mhz, gib, gbs, source, geforce, tensor_mhz, link, tdp_w)


P100_PCIE = _row(
    "P100 PCIe 16GB",
    (6, 0),
    56,
    1303,
    16,
    732,
    "NVIDIA Tesla P100 PCIe datasheet + Pascal GP100 whitepaper",
)
P100_SXM2 = _row(
    "P100 SXM2 16GB",
    (6, 0),
    56,
    1480,
    16,
    732,
    "NVIDIA Tesla P100 SXM2 datasheet + Pascal GP100 whitepaper",
    link="nvlink1",
)
TITAN_XP = _row(
    "TITAN Xp 12GB",
    (6, 1),
    30,
    1582,
    12,
    547.7,
    "NVIDIA TITAN Xp product page (3840 CUDA cores, 1582 MHz, 547.7 GB/s)",
)
GTX_1080TI = _row(
    "GTX 1080 Ti 11GB",
    (6, 1),
    28,
    1582,
    11,
    484,
    "NVIDIA GeForce GTX 1080 Ti product page (3584 cores, 1582 MHz)",
    geforce=True,
)
V100_16 = _row("V100 16GB", (7, 0), 80, 1530, 16, 900, _V100, link="nvlink2", tdp_w=300)
V100_32 = _row("V100 32GB", (7, 0), 80, 1530, 32, 900, _V100, link="nvlink2", tdp_w=300)
V100_PCIE = _row(
    "V100 PCIe 16GB",
    (7, 0),
    80,
    1380,
    16,
    900,
    "NVIDIA Tesla V100 datasheet (PCIe: 1380 MHz, 14 TF fp32, 112 TF tensor, 250 W)",
    tdp_w=250,
)
T4 = _row(
    "T4 16GB",
    (7, 5),
    40,
    1590,
    16,
    320,
    "NVIDIA T4 datasheet + Turing whitepaper (40 SMs, 1590 MHz, 65 TF fp16, 8.1 TF fp32, 70 W)",
    tdp_w=70,
)
# board power (tdp_w): TITAN RTX 280 W, Quadro RTX 6000/8000 260 W (295 W with VirtualLink),
# RTX 2080 Ti 250 W (Turing whitepaper Appendix A, the boards' datasheets)
TITAN_RTX = _row("TITAN RTX 24GB", (7, 5), 72, 1770, 24, 672, _TU, tdp_w=280)
QUADRO_RTX8000 = _row("Quadro RTX 8000 48GB", (7, 5), 72, 1770, 48, 672, _TU, tdp_w=260)
QUADRO_RTX6000 = _row("Quadro RTX 6000 24GB", (7, 5), 72, 1770, 24, 672, _TU, tdp_w=260)
RTX_2080TI = _row("RTX 2080 Ti 11GB", (7, 5), 68, 1545, 11, 616, _TU, geforce=True, tdp_w=250)
A100_40 = _row("A100 40GB", (8, 0), 108, 1410, 40, 1555, _A100, link="nvlink3")
A100_80 = _row("A100 80GB", (8, 0), 108, 1410, 80, 2039, _A100, link="nvlink3")
A100_80_PCIE = _row("A100 80GB PCIe", (8, 0), 108, 1410, 80, 1935, _A100, link="pcie4")
A10 = _row(
    "A10 24GB",
    (8, 6),
    72,
    1695,
    24,
    600,
    "NVIDIA A10 datasheet (125 TF bf16 dense, 31.2 TF fp32) + GA102 whitepaper",
    link="pcie4",
)
A40 = _row(
    "A40 48GB",
    (8, 6),
    84,
    1740,
    48,
    696,
    "NVIDIA A40 datasheet (149.7 TF bf16 dense, 37.4 TF fp32) + GA102 whitepaper",
    link="pcie4",
)
RTX_A6000 = _row(
    "RTX A6000 48GB",
    (8, 6),
    84,
    1800,
    48,
    768,
    "NVIDIA RTX A6000 datasheet (154.8 TF tensor dense, 38.7 TF fp32)",
    link="pcie4",
)
RTX_3090 = _row("RTX 3090 24GB", (8, 6), 82, 1695, 24, 936, _GA102, geforce=True, link="pcie4")
RTX_4090 = _row("RTX 4090 24GB", (8, 9), 128, 2520, 24, 1008, _AD, geforce=True, link="pcie4")
RTX_6000_ADA = _row(
    "RTX 6000 Ada 48GB",
    (8, 9),
    142,
    2505,
    48,
    960,
    "NVIDIA RTX 6000 Ada datasheet + Ada whitepaper",
    link="pcie4",
)
L4 = _row(
    "L4 24GB",
    (8, 9),
    58,
    2040,
    24,
    300,
    "NVIDIA L4 datasheet (121 TF bf16 dense, 30.3 TF fp32) + Ada whitepaper",
    link="pcie4",
)
L40S = _row(
    "L40S 48GB",
    (8, 9),
    142,
    2520,
    48,
    864,
    "NVIDIA L40S datasheet (362 TF bf16 dense, 91.6 TF fp32)",
    link="pcie4",
)
H100_SXM = _row(
    "H100 SXM 80GB", (9, 0), 132, 1980, 80, 3352, _H100, tensor_mhz=1830, link="nvlink4"
)
H100_PCIE = _row(
    "H100 PCIe 80GB", (9, 0), 114, 1755, 80, 2000, _H100, tensor_mhz=1620, link="pcie5"
)
H200 = _row(
    "H200 141GB",
    (9, 0),
    132,
    1980,
    141,
    4800,
    "NVIDIA H200 datasheet (GH100 as H100 SXM; 141 GB HBM3e, 4.8 TB/s)",
    tensor_mhz=1830,
    link="nvlink4",
)

#: GRES type, normalised (:func:`normalise_gpu_type`) -> spec row
SPEC_TABLE: Dict[str, GpuSpec] = {
    "p100": P100_PCIE,
    "p100pcie": P100_PCIE,
    "p10016": P100_PCIE,
    "p100sxm2": P100_SXM2,
    "titanxp": TITAN_XP,
    "xp": TITAN_XP,
    "gtx1080ti": GTX_1080TI,
    "1080ti": GTX_1080TI,
    "v100": V100_16,
    "v10016": V100_16,
    "v10032": V100_32,
    "v100sxm2": V100_16,
    "v100pcie": V100_PCIE,
    "t4": T4,
    "titanrtx": TITAN_RTX,
    "rtx2080ti": RTX_2080TI,
    "2080ti": RTX_2080TI,
    "quadrortx8000": QUADRO_RTX8000,
    "rtx8000": QUADRO_RTX8000,
    "quadrortx6000": QUADRO_RTX6000,
    "rtx6000": QUADRO_RTX6000,
    "a100": A100_40,
    "a10040": A100_40,
    "a10080": A100_80,
    "a100pcie": A100_40,
    "a10040pcie": A100_40,
    "a10080pcie": A100_80_PCIE,
    "a10": A10,
    "a40": A40,
    "rtxa6000": RTX_A6000,
    "a6000": RTX_A6000,
    "rtx3090": RTX_3090,
    "3090": RTX_3090,
    "rtx4090": RTX_4090,
    "4090": RTX_4090,
    "rtx6000ada": RTX_6000_ADA,
    "l4": L4,
    "l40s": L40S,
    "h100": H100_SXM,
    "h100sxm": H100_SXM,
    "h10080": H100_SXM,
    "h100pcie": H100_PCIE,
    "h200": H200,
}

#: product names as NVML reports them (pynvml, nvidia-smi: "NVIDIA H100 80GB HBM3", "Tesla
#: V100-SXM2-32GB"), normalised, where they differ from a GRES name above: what a probe reads
PRODUCT_NAMES: Dict[str, GpuSpec] = {
    "h10080gbhbm3": H100_SXM,
    "a100sxm440": A100_40,
    "a100sxm480": A100_80,
    "a100pcie40": A100_40,
    "a10080gbpcie": A100_80_PCIE,
    "v100sxm216": V100_16,
    "v100sxm232": V100_32,
    "v100pcie16": V100_PCIE,
    "v100pcie32": V100_PCIE,
    "p100pcie16": P100_PCIE,
    "p100pcie12": P100_PCIE,
    "p100sxm216": P100_SXM2,
    "rtx6000adageneration": RTX_6000_ADA,
}


def normalise_gpu_type(gpu_type: str) -> str:
    """``"A100_80GB"`` -> ``"a10080"``: lower case, without ``nvidia``/``geforce``, separators
    and a trailing ``gb``."""
    key = "".join(ch for ch in str(gpu_type).lower() if ch.isalnum())
    for word in ("nvidia", "geforce", "tesla"):
        key = key.replace(word, "")
    for suffix in ("gb", "g"):
        if key.endswith(suffix) and key[: -len(suffix)][-1:].isdigit():
            key = key[: -len(suffix)]
            break
    return key


def find_spec(gpu_type: str) -> Optional[GpuSpec]:
    """The spec row of a GRES type or an NVML product name (:data:`PRODUCT_NAMES`), or None."""
    key = normalise_gpu_type(gpu_type)
    return SPEC_TABLE.get(key) or PRODUCT_NAMES.get(key)


def spec_from_probe(probe: Mapping[str, Any]) -> Optional[GpuSpec]:
    """A spec row from a probe's device facts (``DeviceProbe.to_dict()``: ``kind``, ``name``,
    ``sm_count``, ``sm_clock_mhz``, ``compute_capability``, ``memory_total_bytes``); the SM
    count, clock and capability the probe read win over any table row. GeForce is told from
    the name. None for a CPU probe or one without SMs, clock or capability."""
    if not probe or probe.get("kind") != "cuda":
        return None
    sms, mhz, cap = (
        probe.get("sm_count"),
        probe.get("sm_clock_mhz"),
        probe.get("compute_capability"),
    )
    if not (sms and mhz and cap):
        return None
    name = str(probe.get("name") or "GPU").replace("NVIDIA ", "")
    known = find_spec(name)
    lowered = name.lower()
    geforce = (
        known.geforce
        if known
        else (
            "geforce" in lowered
            or lowered.startswith(("rtx 20", "rtx 30", "rtx 40", "rtx 50", "gtx"))
        )
    )
    memory = float(probe.get("memory_total_bytes") or 0) / 2**30 or (
        known.memory_gib if known else 0
    )
    return GpuSpec(
        name,
        (int(cap[0]), int(cap[1])),
        int(sms),
        float(mhz),
        memory,
        known.bandwidth_gbs if known else 0.0,
        "pynvml probe (SMs, max SM clock, compute capability)",
        geforce,
        None,
        known.gpu_link if known else "pcie3",
    )
