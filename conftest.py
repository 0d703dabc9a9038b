# Triton decides between compiling and interpreting when a kernel is defined, so the interpreter
# switch must be set before anything imports triton. On a machine with CUDA, GPTSERVE_TRITON_CUDA=1
# keeps the real compiler (bench/gpu_check.sh sets it).
import os

if os.environ.get("GPTSERVE_TRITON_CUDA") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")
