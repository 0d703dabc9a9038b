"""A native llama.cpp build for this host: find it (or build it) and run its own benchmarks.

The rival of the speed goals is llama.cpp compiled for the host (`-DGGML_NATIVE=ON`), not the
generic build that a Python wheel may carry. `find_native()` looks for `llama-bench` and
`llama-batched-bench` in `$LLAMACPP_BIN`, then in the folder `bench/build_llamacpp.sh` builds into
(`~/.cache/llamacpp-native/llama.cpp/build/bin`); `build_native()` runs that script (about
8 minutes on 2 cores, once).

    python bench/llamacpp_native.py --gguf FILE [--threads 2]   # tg64, pp512, 16 and 32 streams
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BUILD_SCRIPT = Path(__file__).resolve().with_name("build_llamacpp.sh")
DEFAULT_BIN = Path.home() / ".cache" / "llamacpp-native" / "llama.cpp" / "build" / "bin"
TOOLS = ("llama-bench", "llama-batched-bench")


@dataclass(frozen=True)
class NativeBuild:
    """The folder holding a native build's benchmark tools."""

    bin_dir: Path

    def tool(self, name: str) -> str:
        return str(self.bin_dir / name)

    def describe(self) -> str:
        # build/: for this host (-DGGML_NATIVE=ON); build-avx2/: for AVX2 hosts (LLAMACPP_ISA=avx2)
        flavour = "AVX2 build" if self.bin_dir.parent.name.endswith("avx2") else "native build"
        return f"llama.cpp, {flavour} ({self.bin_dir.parent.name})"


def find_native() -> NativeBuild | None:
    """The native build in $LLAMACPP_BIN or the default build folder, or None."""
    candidates = [Path(os.environ["LLAMACPP_BIN"])] if os.environ.get("LLAMACPP_BIN") else []
    for folder in [*candidates, DEFAULT_BIN]:
        if all(os.access(folder / tool, os.X_OK) for tool in TOOLS):
            return NativeBuild(folder)
    return None


def build_native() -> NativeBuild:
    """Build llama.cpp for this host with bench/build_llamacpp.sh (minutes) and return it."""
    out = subprocess.run(["bash", str(BUILD_SCRIPT)], check=True, capture_output=True, text=True)
    return NativeBuild(Path(out.stdout.strip().splitlines()[-1]))


def tg_pp(build: NativeBuild, gguf: Path, threads: int, n_gen: int = 64, n_prompt: int = 512,
          repetitions: int = 3) -> dict[str, float]:  # fmt: skip
    """llama-bench's tokens/s for generating `n_gen` tokens (tg) and a `n_prompt` prompt (pp)."""
    cmd = [build.tool("llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt),
           "-n", str(n_gen), "-r", str(repetitions), "-o", "json"]  # fmt: skip
    rows = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    rates: dict[str, float] = {}
    for row in rows:
        key = f"tg{row['n_gen']}" if row["n_gen"] else f"pp{row['n_prompt']}"
        rates[key] = float(row["avg_ts"])
    return rates


def batched(build: NativeBuild, gguf: Path, threads: int, streams: int, prompt: int = 64,
            new: int = 64) -> float:  # fmt: skip
    """Seconds llama-batched-bench takes for `streams` sequences of `prompt` + `new` tokens."""
    ctx = streams * (prompt + new) + 256
    cmd = [build.tool("llama-batched-bench"), "-m", str(gguf), "-t", str(threads),
           "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(prompt), "-ntg", str(new),
           "-npl", str(streams), "--output-format", "jsonl"]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return float(rows[-1]["t"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--build", action="store_true", help="build llama.cpp when none is found")
    args = p.parse_args()
    build = find_native() or (build_native() if args.build else None)
    if build is None:
        sys.exit("no native llama.cpp build: set LLAMACPP_BIN or pass --build")
    print(build.describe())
    print(tg_pp(build, args.gguf, args.threads))
    for streams in (16, 32):
        print(
            f"{streams} streams x (64 + 64): {batched(build, args.gguf, args.threads, streams):.2f} s"
        )


if __name__ == "__main__":
    main()
