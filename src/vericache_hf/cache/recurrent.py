"""The layers of a hybrid model that keep a recurrent, linear-attention or convolution state instead of a KV cache
(Qwen3-Next, Qwen3.5, OLMo-Hybrid, Kimi-Linear, Jamba, Bamba, Nemotron-H, ...), or beside one (Falcon-H1, Zamba2:
`PairedLayer` in `layers.py`).

Their state is small and exact, so it has a single tier, on the layer's device, which draft and verify passes both
read: there is nothing to compress. What the two passes need is roll-back, as vLLM and SGLang keep for their Mamba
and gated-delta layers:
- a draft advances the state past the tokens the verify pass will accept, so `save_state` copies it before drafting and
  `restore_state` puts the copy back after;
- a verify pass records the state after each of its tokens (`record_states`: transformers' past recording, in which the
  model hands over every intermediate recurrent state and the convolution keeps its whole input), and
  `keep_states` gives each row the state after exactly the tokens it accepted.

The state a row carries after its accepted tokens is what a stock decode of those tokens leaves, whatever slots
another row's acceptance left masked in the attention layers: a recurrent layer never sees a masked slot, because
every pass feeds it only real tokens.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import LinearAttentionLayer

#: How many intermediate states a verify pass asks the model to keep: all of them, however long its block.
_EVERY_TOKEN = 1 << 30


class RecurrentLayer(LinearAttentionLayer):
    """transformers' linear-attention cache layer, with the roll-back drafting and verification need."""

    def __init__(self, layer_idx: int, number_of_states: int = 1) -> None:
        super().__init__(number_of_states=number_of_states)
        self.layer_idx = layer_idx
        self._saved: tuple[dict, dict, torch.Tensor] | None = None

    def save_state(self) -> None:
        """Copy the state, to be put back by `restore_state` (after drafting, or a failed verify pass)."""
        self._saved = (
            {i: s.clone() for i, s in self.conv_states.items() if s is not None},
            {i: s.clone() for i, s in self.recurrent_states.items() if s is not None},
            self.cumulative_length_linear.clone(),
        )

    def restore_state(self) -> None:
        """Put back the state `save_state` copied, and stop recording."""
        conv, recurrent, length = self._saved
        self.conv_states.update(conv)
        self.recurrent_states.update(recurrent)
        self.cumulative_length_linear = length
        self._saved = None
        self._stop_recording()

    def record_states(self) -> None:
        """Keep the state after every token of the coming verify pass."""
        self.save_state()
        self.record_past = True
        self.recurrent_states_to_keep = _EVERY_TOKEN
        self.recurrent_states_history = {i: [] for i in range(self.number_of_states)}

    def keep_states(self, count: int, valid: torch.Tensor) -> None:
        """Give each row the state after the verify pass's tokens it accepted: `valid` (B, count) marks them, a
        prefix of the pass's first `count` tokens per row."""
        kept = valid.sum(-1)
        if not torch.equal(valid, torch.arange(valid.shape[-1])[None, :] < kept[:, None]):
            raise RuntimeError("a recurrent layer commits a prefix of each row's verified tokens")
        for i in range(self.number_of_states):
            if self.is_recurrent_states_initialized[i]:
                # after t of the pass's tokens: history[t] for t < q (history[0] is the state before the pass)
                after = [*self.recurrent_states_history[i], self.recurrent_states[i]]
                stacked = torch.stack(after)  # (q + 1, B, ...)
                rows = torch.arange(stacked.shape[1], device=stacked.device)
                self.recurrent_states[i] = stacked[kept.to(stacked.device), rows].contiguous()
            if self.is_conv_states_initialized[i]:
                # the convolution's window before the pass, then the pass's inputs: a row's window ends after its
                # accepted tokens
                inputs, width = self.conv_states[i], self.conv_kernel_size[i]
                self.conv_states[i] = torch.stack(
                    [inputs[row, ..., int(t) : int(t) + width] for row, t in enumerate(kept)]
                )
        self.cumulative_length_linear = self._saved[2] + count
        self._saved = None
        self._stop_recording()

    def _stop_recording(self) -> None:
        self.record_past = False
        self.recurrent_states_to_keep = 0
        self.recurrent_states_history = {i: [] for i in range(self.number_of_states)}

    def state_bytes(self) -> int:
        states = [*self.conv_states.values(), *self.recurrent_states.values()]
        return sum(s.numel() * s.element_size() for s in states if s is not None)
