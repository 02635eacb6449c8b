"""Models with chosen weights, shared by the generation, weights and finetuning tests (not a test file)."""

import torch

from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT

# The choices beyond GPT-2 and Llama, as small models: Gemma 3's (sliding layers with their own RoPE base, a
# window shorter than the prompts, post-norms, scaled embeddings, GeGLU, QK-norm, its own score scale) and a
# mixture of experts (5 experts, top 2, a shared expert, a dense layer)
LATER_SHAPES = {
    "gemma": dict(vocab_size=101, d_model=40, n_layers=3, n_heads=4, n_kv_heads=2, head_size=12, norm="rmsnorm",
                  mlp="geglu", position="rope", qkv_bias=False, bias=False, qk_norm=True, post_norms=True,
                  scale_embeddings=True, sliding_window=5, layer_types=("sliding", "full", "sliding"),
                  rope_theta=100_000.0, rope_local_theta=10_000.0, rope_scaling=2.0, query_scale=16.0,
                  tie_embeddings=False),  # tied, the scaled embedding of a random model predicts its own token
    "moe": dict(vocab_size=79, d_model=48, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64, norm="rmsnorm",
                mlp="swiglu", position="rope", qkv_bias=False, bias=False, n_experts=5, experts_per_token=2,
                d_expert=24, shared_experts=1, dense_layers=(1,)),
}


def randomize(model: torch.nn.Module, seed: int, scale: float) -> None:
    """Every parameter random, norm gains near 1: nothing hides behind zeros or ones, and weights of
    scale 0.2 or more keep greedy decoding from settling on one repeated token."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            is_gain = param.dim() == 1 and ("norm" in name or "ln" in name) and name.endswith("weight")
            param.copy_(1.0 + 0.1 * noise if is_gain else scale * noise)


def successor_model(successor: dict[int, int], vocab_size: int, context_length: int = 64,
                    strength: float = 1.0) -> GPT:
    """A GPT whose greedy next token is successor[last token], whatever came before.

    The blocks add nothing (zero output projections); each token of the map embeds as its own
    one-hot direction, and the head's row for successor[t] points along t's direction with
    ``strength`` (the logit margin of the right token).
    """
    model = GPT(GPTConfig(vocab_size=vocab_size, context_length=context_length, d_model=len(successor) + 1,
                          n_layers=1, n_heads=1, tie_embeddings=False))
    with torch.no_grad():
        for param in model.parameters():
            param.zero_()
        model.final_norm.weight.fill_(1.0)
        for slot, (token, following) in enumerate(successor.items()):
            model.token_embedding.weight[token, slot] = 1.0
            model.lm_head.weight[following, slot] = strength
    return model.eval()
