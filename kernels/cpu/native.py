"""The CPU wing's compiled kernels: built once per host, then loaded.

A decode step of a small model is many small layers, and PyTorch spends a few microseconds of
dispatch on each operation however little it computes: the attention of one new token took about
36 operations a layer (`kernels.cpu.decode`), a RMSNorm before a bfloat16 product nine and a cast.
These take one call each:

- `paged_decode` (paged_decode.cpp): a layer's key/value writes and every decoding sequence's
  attention over its blocks where they lie (`kernels.backends.CpuPagedBackend`);
- `rms_norm` and `silu_mul` (row_ops.cpp): RMSNorm and SwiGLU's silu(gate) * up in float32,
  written in the dtype of the product that follows (`model.cpu.optimize`);
- `int4_matmul` (int4_matmul.cpp): products with int4 weights in groups of 32, a GGUF file's
  Q4_0, Q4_1, Q4_K and Q8_0 matrices (`model.int4_linear`);
- `int4_q8_matmul` (int4_q8_matmul.cpp): the same int4 matrices times rows rounded to 8 bits
  per block of 32, as llama.cpp multiplies them (`--int8-activations`, opt-in);
- `kquant_matmul` and `kquant_dequantize` (kquant_matmul.cpp): products with a GGUF file's Q5_K
  and Q6_K blocks as the file stores them, and their weights in float32 (`model.kquant_linear`);
- `f32_matmul` (f32_matmul.cpp): float32 products of a few rows, the matrix read as tiles of 32
  output columns (`model.cpu.few_rows_linear`);
- `q8_matmul` (q8_matmul.cpp): int8 products, the rows quantized to 8 bits per block of 32 and
  multiplied byte by byte (`model.quantize.Int8Linear`);
- `logit_stats` (logit_stats.cpp): each row of logits' argmax and log-sum-exp, what the sampler
  reads of them (`engine.sampler`);
- `lora_update_` (lora_update.cpp): a LoRA adapter's update of a few rows of a product's output
  (`model.lora.batched`), also called by the one-call Llama layer (llama_layer.cpp).

They are compiled with PyTorch's extension builder (a C++ compiler and ninja, found on most
Linux hosts; `pip install ninja` for the latter) for the host's own instruction set, the first
time a process asks for them (20-60 s; a log line says what is compiled, for which target and
where the build is kept); later processes load the build from PyTorch's extension cache
(`TORCH_EXTENSIONS_DIR`, by default under ~/.cache) in a fraction of a second. Where they cannot
be built, one line says why and PyTorch operations serve instead, with the same results within
rounding. `GPTSERVE_NATIVE=0` keeps PyTorch operations (benchmarks compare the two that way).

`gptserve fetch --kernels x86-64-v3,x86-64-v4` builds them ahead of time for named `-march`
targets (the Docker image does, so that a container starts ready): a process then loads the
host's own build when one is in the cache, else the best prebuilt target this host can run, and
only with neither compiles its own. `GPTSERVE_NATIVE_ARCH` names the one target to use (build if
need be): `native` always takes the host's own build, `x86-64-v3` an AVX2 one on an AVX-512 host,
as docs/BENCHMARKS.md's AVX2 runs do.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import re
import sys
import time
from functools import cache
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "paged_decode.cpp",
        "row_ops.cpp",
        "int4_matmul.cpp",
        "int4_q8_matmul.cpp",
        "f32_matmul.cpp",
        "q8_matmul.cpp",
        "logit_stats.cpp",
        "decode_layer.cpp",
        "llama_layer.cpp",
        "lora_update.cpp",
        "kquant_matmul.cpp",
    )
]
HEADERS = [
    Path(__file__).with_name(name)
    for name in (
        "vec_math.h",
        "vec_f32.h",
        "layer_calls.h",
        "lora_update.h",
        "row_blocks.h",
        "int4_tiles.h",
    )
]
# OpenMP: at::parallel_for's threads are torch's. -fno-trapping-math lets loops with a clamp or
# a select (fast_exp's) vectorize without AVX-512's masks; it changes no value computed, only
# which floating-point exception flags may be raised, which nothing here reads.
FLAGS = ["-O3", "-fopenmp", "-fno-trapping-math"]


def host_tag() -> str:
    """A short name for this CPU's instruction sets: builds for `-march=native` are kept apart
    per tag, so an extension cache shared by hosts of two kinds never hands one the other's."""
    flags = platform.machine()
    try:
        with open("/proc/cpuinfo") as info:  # x86 says "flags", ARM "Features"
            flags += next((ln for ln in info if ln.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def enabled() -> bool:
    """Whether the environment allows the compiled kernels (`GPTSERVE_NATIVE`, default on)."""
    return os.environ.get("GPTSERVE_NATIVE", "1").strip().lower() not in ("0", "false", "no", "off")


# Prebuilt targets, best first, with the cpuinfo flags each needs (x86-64 psABI levels 3 and 4).
BASELINES: dict[str, set[str]] = {
    "x86-64-v4": {"avx2", "fma", "bmi2", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "x86-64-v3": {"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"},
}
# what the log names of a host's instruction sets
NAMED_SETS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512_bf16",
    "avx512_vnni",
    "amx_tile",
    "neon",
    "asimd",
    "sve",
)


def host_flags() -> set[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:  # x86 says "flags", ARM "Features"
            line = next((ln for ln in info if ln.startswith(("flags", "Features"))), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def instruction_sets() -> str:
    """This host's vector instruction sets, for the log: "avx2, fma, avx512f"."""
    named = [name for name in NAMED_SETS if name in host_flags()]
    return ", ".join(named) or "no vector extensions listed"


def build_root() -> Path:
    """PyTorch's extension cache, where builds live (as torch.utils.cpp_extension finds it)."""
    from torch.utils.cpp_extension import get_default_build_root

    if root := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(root)
    accelerator = (
        f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip
        else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda
        else "cpu"
    )  # fmt: skip
    version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{version}_{accelerator}"


def build_name(arch: str) -> str:
    """The build's name: what it was built from (the sources, headers and torch) and for which
    target; a `native` build also names the host, so that a cache shared by hosts of two kinds
    never hands one the other's."""
    code = hashlib.sha256(torch.__version__.encode())  # PyTorch rebuilds on a source change only
    for path in SOURCES + HEADERS:
        code.update(path.read_bytes())
    host = host_tag() if arch == "native" else "any"
    return f"gptserve_cpu_{host}_{re.sub(r'[^0-9A-Za-z]', '_', arch)}_{code.hexdigest()[:8]}"


def _load_built(arch: str) -> bool:
    """Load the cached build for `arch` if there is one; False when there is none (or a build cut
    short while it was written, which is removed so that it is built again)."""
    built = build_root() / build_name(arch) / f"{build_name(arch)}.so"
    if not built.is_file():
        return False
    try:
        torch.ops.load_library(str(built))
    except OSError:
        built.unlink(missing_ok=True)
        return False
    if arch != "native":
        log.info("CPU kernels: the prebuilt -march=%s build (%s)", arch, built.parent)
    return True


def _build(arch: str) -> None:
    """Compile the kernels for `-march=arch` into the extension cache and load them."""
    from torch.utils.cpp_extension import _get_build_directory, load

    name = build_name(arch)
    folder = Path(_get_build_directory(name, verbose=False))
    _clear_stale_lock(folder)
    host = f" (this host: {instruction_sets()})" if arch == "native" else ""
    log.info(
        "compiling the CPU kernels once: %d C++ files from %s for -march=%s%s into %s; later "
        "starts load this build", len(SOURCES), SOURCES[0].parent, arch, host, folder,
    )  # fmt: skip
    start = time.perf_counter()
    flags = [*FLAGS, f"-march={arch}"]
    load(name, [str(p) for p in SOURCES], flags, extra_ldflags=["-fopenmp"], is_python_module=False)
    log.info("compiled the CPU kernels in %.1f s", time.perf_counter() - start)


def runnable_baselines() -> list[str]:
    """The prebuilt targets this host can run, best first."""
    flags = host_flags()
    return [arch for arch, needs in BASELINES.items() if needs <= flags]


@cache
def native_ops() -> Any | None:
    """torch.ops.gptserve_cpu, loaded (or built) on first use; None where it cannot be (no
    compiler, no ninja, `GPTSERVE_NATIVE=0`), said once in the log."""
    if not enabled():
        return None
    try:
        chosen = os.environ.get("GPTSERVE_NATIVE_ARCH", "").strip()
        for arch in [chosen] if chosen else ["native", *runnable_baselines()]:
            if _load_built(arch):
                return torch.ops.gptserve_cpu
        _build(chosen or "native")
        return torch.ops.gptserve_cpu
    except Exception as exc:  # noqa: BLE001 - any build failure means: use PyTorch operations
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        log.warning("CPU kernels not built (%s); using PyTorch operations", first)
        return None


def _clear_stale_lock(build_dir: Path, stale_after: float = 300.0) -> None:
    """Remove a build lock left by a process killed while compiling (PyTorch's builder waits on
    it forever); a build takes well under `stale_after` seconds."""
    lock = build_dir / "lock"
    try:
        if time.time() - lock.stat().st_mtime > stale_after:
            lock.unlink()
            log.warning("removed a stale build lock %s", lock)
    except FileNotFoundError:
        pass


def paged_decode_op() -> Any | None:
    """The compiled `paged_decode`, or None (`native_ops`)."""
    ops = native_ops()
    return None if ops is None else ops.paged_decode


def logit_stats_op() -> Any | None:
    """The compiled `logit_stats`, or None (`native_ops`)."""
    ops = native_ops()
    return None if ops is None else ops.logit_stats
