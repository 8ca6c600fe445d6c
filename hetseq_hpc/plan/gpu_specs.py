"""NVIDIA GPUs from their specifications: SM count, boost clock, compute capability, memory and
memory bandwidth, and from these the peak FLOP/s per precision.

Peak = SMs x FLOP per SM per clock (by architecture, :data:`ARCHS`) x clock. The same function
(:func:`peak_flops`) takes the facts the pynvml probe reads (``sm_count``, ``sm_clock_mhz``,
``compute_capability``, :class:`hetseq_hpc.env.hardware.DeviceProbe`), so a probed GPU that is in
no table still gets a peak (:func:`spec_from_probe`); the probe is preferred when present.

Assumptions (stated once, here):

- "fp16"/"bf16" = the tensor-core rate with FP32 ACCUMULATE (what autocast's cuBLAS GEMMs use).
  GeForce Turing/Ampere/Ada cards run that at HALF the rate of their fp16-accumulate figure
  (Turing/GA102/AD102 whitepapers' "FP16 Tensor TFLOPS with FP32 Accumulate"): ``geforce=True``
  halves the tensor and TF32 rates. Quadro/RTX A-series/data-centre parts run it at full rate.
- Volta/Turing have no bf16: a bf16 peak there is the fp16 one (the runtime falls back to fp16).
- Pascal has no tensor cores: half precision is 2x fp32 on GP100 (P100, cc 6.0) and 1/64 of it
  on GP102 (TITAN Xp, GTX 1080 Ti, cc 6.1); the runtime trains in fp32 there (``auto``).
- TF32 (Ampere and later) is a peak the RUNTIME DOES NOT USE: hetseq_hpc leaves PyTorch's default
  (``torch.backends.cuda.matmul.allow_tf32 = False``), so "fp32" is the CUDA-core fp32 peak on
  every GPU. ``tf32`` exists to read published figures (NGC containers turn TF32 on).
- H100/H200: NVIDIA quotes tensor peaks at a lower clock than the fp32 ones (989.4 TFLOP/s
  dense bf16 = 132 SMs x 4096 x 1830 MHz, while 66.9 TFLOP/s fp32 = 132 x 256 x 1980 MHz); the
  row's ``tensor_mhz`` keeps that. A probe reads only the maximum SM clock, so a probed Hopper's
  tensor peak comes out ~8 % above the datasheet's.
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
        half_vs_fp32: half-precision rate over fp32 without tensor cores (Pascal).
        bf16: whether the tensor cores run bf16.
    """

    name: str
    fp32_lanes: int
    tensor: int = 0
    tf32: int = 0
    half_vs_fp32: float = 1.0
    bf16: bool = False


#: compute capability -> architecture (Pascal .. Hopper whitepapers' per-SM rates)
ARCHS: Dict[Tuple[int, int], Arch] = {
    (6, 0): Arch("Pascal GP100", 64, half_vs_fp32=2.0),
    (6, 1): Arch("Pascal GP10x", 128, half_vs_fp32=1.0),
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
        raise ConfigError(f"compute capability {cap[0]}.{cap[1]} is older than Pascal (6.0), "
                          "which the planner has no rates for: measure it with plan.probe=")
    return ARCHS[max(older)]


def peak_flops(capability: Tuple[int, int], sm_count: int, clock_mhz: float, precision: str,
               geforce: bool = False, tensor_mhz: Optional[float] = None) -> float:
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
        raise ConfigError(f"precision {precision!r} has no peak: use one of "
                          f"{', '.join(PEAK_PRECISIONS)}")
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

    def peak_flops(self, precision: str) -> float:
        """Peak FLOP/s in ``precision`` (:func:`peak_flops` on this row's facts)."""
        return peak_flops(self.capability, self.sm_count, self.boost_mhz, precision,
                          self.geforce, self.tensor_mhz)

    @property
    def tensor_dtype(self) -> str:
        """``bf16`` where the tensor cores run it (cc >= 8.0), else ``fp16``."""
        return "bf16" if arch_for(self.capability).bf16 else "fp16"


_V100 = "NVIDIA Tesla V100 datasheet + Volta whitepaper (SXM2: 80 SMs, 1530 MHz, 900 GB/s)"
_A100 = "NVIDIA A100 datasheet + whitepaper (108 SMs, 1410 MHz; 1555/2039 GB/s SXM, 1935 PCIe 80GB)"
_TU = "NVIDIA Turing architecture whitepaper, Appendix A"
_GA102 = "NVIDIA Ampere GA102 whitepaper"
_AD = "NVIDIA Ada Lovelace architecture whitepaper"
_H100 = ("NVIDIA H100 datasheet + whitepaper (SXM5 132 SMs, 1980 MHz, 3352 GB/s, tensor peaks at "
         "1830 MHz; PCIe 114 SMs, 1755 MHz, 2000 GB/s, tensor peaks at 1620 MHz)")


def _row(label: str, cc: Tuple[int, int], sms: int, mhz: float, gib: float, gbs: float,
         source: str, geforce: bool = False, tensor_mhz: Optional[float] = None) -> GpuSpec:
    return GpuSpec(label, cc, sms, mhz, gib, gbs, source, geforce, tensor_mhz)


P100_PCIE = _row("P100 PCIe 16GB", (6, 0), 56, 1303, 16, 732,
                 "NVIDIA Tesla P100 PCIe datasheet + Pascal GP100 whitepaper")
P100_SXM2 = _row("P100 SXM2 16GB", (6, 0), 56, 1480, 16, 732,
                 "NVIDIA Tesla P100 SXM2 datasheet + Pascal GP100 whitepaper")
TITAN_XP = _row("TITAN Xp 12GB", (6, 1), 30, 1582, 12, 547.7,
                "NVIDIA TITAN Xp product page (3840 CUDA cores, 1582 MHz, 547.7 GB/s)")
GTX_1080TI = _row("GTX 1080 Ti 11GB", (6, 1), 28, 1582, 11, 484,
                  "NVIDIA GeForce GTX 1080 Ti product page (3584 cores, 1582 MHz)", geforce=True)
V100_16 = _row("V100 16GB", (7, 0), 80, 1530, 16, 900, _V100)
V100_32 = _row("V100 32GB", (7, 0), 80, 1530, 32, 900, _V100)
V100_PCIE = _row("V100 PCIe 16GB", (7, 0), 80, 1380, 16, 900,
                 "NVIDIA Tesla V100 datasheet (PCIe: 1380 MHz, 14 TF fp32, 112 TF tensor)")
T4 = _row("T4 16GB", (7, 5), 40, 1590, 16, 320,
          "NVIDIA T4 datasheet + Turing whitepaper (40 SMs, 1590 MHz, 65 TF fp16, 8.1 TF fp32)")
TITAN_RTX = _row("TITAN RTX 24GB", (7, 5), 72, 1770, 24, 672, _TU)
QUADRO_RTX8000 = _row("Quadro RTX 8000 48GB", (7, 5), 72, 1770, 48, 672, _TU)
QUADRO_RTX6000 = _row("Quadro RTX 6000 24GB", (7, 5), 72, 1770, 24, 672, _TU)
RTX_2080TI = _row("RTX 2080 Ti 11GB", (7, 5), 68, 1545, 11, 616, _TU, geforce=True)
A100_40 = _row("A100 40GB", (8, 0), 108, 1410, 40, 1555, _A100)
A100_80 = _row("A100 80GB", (8, 0), 108, 1410, 80, 2039, _A100)
A100_80_PCIE = _row("A100 80GB PCIe", (8, 0), 108, 1410, 80, 1935, _A100)
A10 = _row("A10 24GB", (8, 6), 72, 1695, 24, 600,
           "NVIDIA A10 datasheet (125 TF bf16 dense, 31.2 TF fp32) + GA102 whitepaper")
A40 = _row("A40 48GB", (8, 6), 84, 1740, 48, 696,
           "NVIDIA A40 datasheet (149.7 TF bf16 dense, 37.4 TF fp32) + GA102 whitepaper")
RTX_A6000 = _row("RTX A6000 48GB", (8, 6), 84, 1800, 48, 768,
                 "NVIDIA RTX A6000 datasheet (154.8 TF tensor dense, 38.7 TF fp32)")
RTX_3090 = _row("RTX 3090 24GB", (8, 6), 82, 1695, 24, 936, _GA102, geforce=True)
RTX_4090 = _row("RTX 4090 24GB", (8, 9), 128, 2520, 24, 1008, _AD, geforce=True)
RTX_6000_ADA = _row("RTX 6000 Ada 48GB", (8, 9), 142, 2505, 48, 960,
                    "NVIDIA RTX 6000 Ada datasheet + Ada whitepaper")
L4 = _row("L4 24GB", (8, 9), 58, 2040, 24, 300,
          "NVIDIA L4 datasheet (121 TF bf16 dense, 30.3 TF fp32) + Ada whitepaper")
L40S = _row("L40S 48GB", (8, 9), 142, 2520, 48, 864,
            "NVIDIA L40S datasheet (362 TF bf16 dense, 91.6 TF fp32)")
H100_SXM = _row("H100 SXM 80GB", (9, 0), 132, 1980, 80, 3352, _H100, tensor_mhz=1830)
H100_PCIE = _row("H100 PCIe 80GB", (9, 0), 114, 1755, 80, 2000, _H100, tensor_mhz=1620)
H200 = _row("H200 141GB", (9, 0), 132, 1980, 141, 4800,
            "NVIDIA H200 datasheet (GH100 as H100 SXM; 141 GB HBM3e, 4.8 TB/s)", tensor_mhz=1830)

#: GRES type, normalised (:func:`normalise_gpu_type`) -> spec row
SPEC_TABLE: Dict[str, GpuSpec] = {
    "p100": P100_PCIE, "p100pcie": P100_PCIE, "p10016": P100_PCIE, "p100sxm2": P100_SXM2,
    "titanxp": TITAN_XP, "xp": TITAN_XP, "gtx1080ti": GTX_1080TI, "1080ti": GTX_1080TI,
    "v100": V100_16, "v10016": V100_16, "v10032": V100_32, "v100sxm2": V100_16,
    "v100pcie": V100_PCIE, "t4": T4, "titanrtx": TITAN_RTX, "rtx2080ti": RTX_2080TI,
    "2080ti": RTX_2080TI, "quadrortx8000": QUADRO_RTX8000, "rtx8000": QUADRO_RTX8000,
    "quadrortx6000": QUADRO_RTX6000, "rtx6000": QUADRO_RTX6000,
    "a100": A100_40, "a10040": A100_40, "a10080": A100_80, "a100pcie": A100_40,
    "a10040pcie": A100_40, "a10080pcie": A100_80_PCIE, "a10": A10, "a40": A40,
    "rtxa6000": RTX_A6000, "a6000": RTX_A6000, "rtx3090": RTX_3090, "3090": RTX_3090,
    "rtx4090": RTX_4090, "4090": RTX_4090, "rtx6000ada": RTX_6000_ADA, "l4": L4, "l40s": L40S,
    "h100": H100_SXM, "h100sxm": H100_SXM, "h10080": H100_SXM, "h100pcie": H100_PCIE,
    "h200": H200,
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
    """The spec row of a GRES type or product name, or None."""
    return SPEC_TABLE.get(normalise_gpu_type(gpu_type))


def spec_from_probe(probe: Mapping[str, Any]) -> Optional[GpuSpec]:
    """A spec row from a probe's device facts (``DeviceProbe.to_dict()``: ``kind``, ``name``,
    ``sm_count``, ``sm_clock_mhz``, ``compute_capability``, ``memory_total_bytes``); the SM
    count, clock and capability the probe read win over any table row. GeForce is told from
    the name. None for a CPU probe or one without SMs, clock or capability."""
    if not probe or probe.get("kind") != "cuda":
        return None
    sms, mhz, cap = probe.get("sm_count"), probe.get("sm_clock_mhz"), probe.get("compute_capability")
    if not (sms and mhz and cap):
        return None
    name = str(probe.get("name") or "GPU").replace("NVIDIA ", "")
    known = find_spec(name)
    lowered = name.lower()
    geforce = known.geforce if known else ("geforce" in lowered or lowered.startswith(
        ("rtx 20", "rtx 30", "rtx 40", "rtx 50", "gtx")))
    memory = float(probe.get("memory_total_bytes") or 0) / 2**30 or (known.memory_gib if known else 0)
    return GpuSpec(name, (int(cap[0]), int(cap[1])), int(sms), float(mhz), memory,
                   known.bandwidth_gbs if known else 0.0, "pynvml probe (SMs, max SM clock, "
                   "compute capability)", geforce, None)
