"""CPU inference layouts for a loaded model, applied from outside it (`optimize_for_cpu`)."""

from gptserve.model.cpu.optimize import is_optimized_for_cpu, optimize_for_cpu

__all__ = ["is_optimized_for_cpu", "optimize_for_cpu"]
