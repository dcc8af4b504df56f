"""`vericache-hf bench`: workloads, methods, a side-by-side runner, quality checks, a report and plots."""

from .command import add_bench_command
from .methods import Method, build_methods
from .runner import Sample, run_bench
from .workloads import PromptBatch, Workload, build_workloads

__all__ = [
    "Method",
    "PromptBatch",
    "Sample",
    "Workload",
    "add_bench_command",
    "build_methods",
    "build_workloads",
    "run_bench",
]
