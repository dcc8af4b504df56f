"""Write your own compressor: score tokens, and VeriCache keeps the best ones as its draft tier, losslessly.

Run: python examples/custom_compressor.py  (a tiny random model; nothing is downloaded)
"""

from dataclasses import dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import vericache_hf  # noqa: F401  (adds generation_mode="vericache")
from vericache_hf import VeriCacheConfig
from vericache_hf.compressors import ScorerCompressor


@dataclass
class ValueNormCompressor(ScorerCompressor):
    """Keep the tokens whose values have the largest norm: they move the attention output most."""

    def score(self, keys, values, context):  # (B, H_kv, T, D) -> (B, H_kv, T), higher is kept
        return values.float().norm(dim=-1)


def main() -> None:
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.float64).eval()
    prompt = torch.randint(3, 96, (1, 64))
    expected = model.generate(prompt, do_sample=False, max_new_tokens=32)
    vericache = VeriCacheConfig(compressor=ValueNormCompressor(compression_ratio=0.75))
    got = model.generate(
        prompt, do_sample=False, max_new_tokens=32, generation_mode="vericache", vericache_config=vericache
    )
    assert torch.equal(got, expected), "VeriCache output must equal stock generate's"
    print("ValueNormCompressor at ratio 0.75: output identical to stock generate")


if __name__ == "__main__":
    main()
