"""What chapter 3's exercises share: the ``CHAPTER`` they register with, and its small models and checks.

The section-9 exercises (``ch03_families``) register with the same chapter as ``ch03``'s, which imports them
after its own so that the notebook's order holds.
"""

import torch
from torch import nn

from llmscratch.exercises.checking import Chapter, attempt, expect_close
from llmscratch.exercises.fixtures import build_module, decoded, token_ids
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import generate  # noqa: F401  (loaded before CHAPTER, which saves the package)
from llmscratch.model.gpt import GPT

VOCAB = 48  # the small models' vocabulary: ids 0 .. 47
LLAMA = dict(norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False)


def small_gpt(llama: bool, seed: int, **overrides) -> GPT:
    """A 2-layer random GPT-2 or Llama-style model (4 query heads on 2 kv heads), weights large enough to matter."""
    torch.manual_seed(seed)
    fields = dict(vocab_size=VOCAB, context_length=16, d_model=16, n_layers=2, n_heads=4)
    fields.update(dict(LLAMA, n_kv_heads=2, tie_embeddings=False) if llama else {})
    model = GPT(GPTConfig(**{**fields, **overrides})).eval()
    with torch.no_grad():  # GPT-2's init gives near-uniform logits, unit gains and zero biases: make them differ
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.5 if "embedding" in name or "lm_head" in name else 0.3)
            else:  # a norm's gain around 1, a bias around 0
                param.copy_(torch.randn_like(param) * 0.2 + (1.0 if "norm" in name and name.endswith("weight") else 0.0))
    return model


def ids(batch: int, seq_len: int, generator: torch.Generator) -> torch.Tensor:
    return token_ids((batch, seq_len), generator, vocab=VOCAB, end_at=(-1, -1))  # (B, T), id 47 in the last row


def build(answer, *args, case: str) -> nn.Module:
    return build_module(answer, *args, case=case, hint="subclass torch.nn.Module and call super().__init__() "
                        "first, so that GPT can hold your module and train its parameters")


def decodes_exactly(model: GPT, idx: torch.Tensor, case: str, hint: str) -> None:
    """Cached decoding, with start_pos and with input_pos (generate's way), must give the full pass's logits."""
    prefill_len = idx.size(1) // 2 or 1
    with torch.no_grad():
        full = attempt(model, idx, case=case)  # (B, T, V)
        for way in ("start_pos", "input_pos"):
            step_case = f"{case}: prefill {prefill_len} tokens, then decode one at a time with {way}"
            got = attempt(decoded, model, idx, prefill_len, tensor_positions=way == "input_pos", case=step_case)
            expect_close(got, full, case=step_case, hint=hint)


CHAPTER = Chapter("ch03", "The GPT architecture")  # last: every module the checks use is loaded
