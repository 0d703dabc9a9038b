"""The host a benchmark ran on, printed first so that its figures can be read against it.

    python bench/host.py

One line: the CPU model and logical CPU count, the instruction sets that decide which kernels run
(AVX2, FMA, AVX-512F, AVX-512 BF16, AVX-512 VNNI, AVX-VNNI, AMX; from /proc/cpuinfo's flags),
torch's version, the kernels it dispatches to and its thread count, any environment variable
that caps those, the memory's read bandwidth measured with torch's threads (a float32 sum of a
tensor far larger than any cache, best of a few), and the 1-minute load average (on a shared
machine, how much else was running).
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

# what the benchmarks print, and the /proc/cpuinfo flag that says the CPU has it
INSTRUCTION_SETS = {
    "AVX2": "avx2",
    "FMA": "fma",
    "AVX-512F": "avx512f",
    "AVX-512 BF16": "avx512_bf16",
    "AVX-512 VNNI": "avx512_vnni",
    "AVX-VNNI": "avx_vnni",
    "AMX": "amx_tile",
}
# settings that make torch or oneDNN use fewer instruction sets or threads than the CPU offers
CAPS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "OMP_NUM_THREADS")


def _cpuinfo() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def cpu_model() -> str:
    info = _cpuinfo()
    return info.get("model name") or platform.processor() or platform.machine() or "unknown CPU"


def instruction_sets() -> dict[str, bool] | None:
    """Each of INSTRUCTION_SETS -> present; None where the flags cannot be read."""
    flags = _cpuinfo().get("flags")
    if flags is None:
        return None
    present = set(flags.split())
    return {name: flag in present for name, flag in INSTRUCTION_SETS.items()}


def read_bandwidth_gbs(mbytes: int = 256, repeats: int = 5) -> float:
    """GB/s at which torch's threads read memory: a float32 sum of `mbytes` MB, best of
    `repeats` (the first, which also faults the pages in, is not counted)."""
    data = torch.ones(mbytes * 1_000_000 // 4)
    data.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - t0)
    return data.numel() * 4 / best / 1e9


def host_line(bandwidth: bool = True) -> str:
    sets = instruction_sets()
    if sets is None:
        isa = "instruction sets unknown"
    else:
        have = [name for name, on in sets.items() if on]
        lack = [name for name, on in sets.items() if not on]
        isa = " ".join(have) if have else "none of " + ", ".join(INSTRUCTION_SETS)
        if lack:
            isa += "; no " + ", ".join(lack)
    kernels = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "?")()
    caps = [f"{k}={os.environ[k]}" for k in CAPS if k in os.environ]
    line = (
        f"host: {cpu_model()}, {os.cpu_count()} logical CPUs; {isa}; torch {torch.__version__} "
        f"({kernels} kernels), {torch.get_num_threads()} threads"
    )
    if caps:
        line += " (" + " ".join(caps) + ")"
    if bandwidth:
        line += f"; memory read {read_bandwidth_gbs():.1f} GB/s"
    if hasattr(os, "getloadavg"):  # other work on the machine
        line += f"; load average {os.getloadavg()[0]:.1f}"
    return line


def print_host(bandwidth: bool = True) -> str:
    """Print the host line (call it after setting torch's thread count); returns it."""
    line = host_line(bandwidth)
    print(line, flush=True)
    return line


if __name__ == "__main__":
    print_host()
