"""vericache_tools: the tooling around the vericache_hf library (the embedded model, long offline prompts,
compressed-only decoding, and the `vericache-hf` command's demo, table and bench).

It uses only vericache_hf's public API; the library imports nothing from here. Extras: `demo` for the embedded
model and prompts, `bench` for the benchmark's plots and progress bars.
"""

from .embedded import load_embedded_model
from .lossy import compressed_only_generate, first_divergence
from .prompts import humaneval_problems, long_code_prompt, long_document_qa_prompt

__all__ = [
    "compressed_only_generate",
    "first_divergence",
    "humaneval_problems",
    "load_embedded_model",
    "long_code_prompt",
    "long_document_qa_prompt",
]
