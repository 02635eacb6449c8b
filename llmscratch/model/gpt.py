"""The GPT model: one class that is GPT-2 or a Llama-style decoder, chosen by its config.

GPT-2: LayerNorm, GELU MLP, learned positions, multi-head attention with biases, tied
embeddings. Llama-style: RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, no biases.
Both are a stack of pre-norm blocks: ``x = x + attention(norm(x)); x = x + mlp(norm(x))``.
"""

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import nn

from llmscratch.model.attention import KVCache, MultiHeadAttention
from llmscratch.model.config import GPTConfig
from llmscratch.model.losses import head_cross_entropy
from llmscratch.model.mlp import GELUMLP, SquaredReLUMLP, SwiGLU
from llmscratch.model.moe import MoE
from llmscratch.model.norm import RMSNorm
from llmscratch.model.rope import RotaryEmbedding


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """One transformer block: pre-norm attention and pre-norm MLP, each added to the residual.

    Block ``layer`` of its config: a sliding or full attention layer (``config.attention_types``), a dense MLP or a
    mixture of experts (``config.is_moe``); with post_norms, each sublayer's output is normalised too (Gemma).
    """

    def __init__(self, config: GPTConfig, layer: int = 0):
        super().__init__()
        sliding = config.attention_types[layer] == "sliding"
        self.attn_norm = make_norm(config)
        self.attn = MultiHeadAttention(
            config.d_model, config.d_model, config.n_heads, config.kv_heads, qkv_bias=config.qkv_bias,
            out_bias=config.bias, dropout=config.dropout, fused=config.fused_attention,
            qk_norm=config.qk_norm, norm_eps=config.norm_eps, head_dim=config.head_size,
            sliding_window=config.sliding_window if sliding else None,
            scale=None if config.query_scale is None else config.query_scale ** -0.5,
        )
        self.attn_post_norm = make_norm(config) if config.post_norms else None
        self.mlp_norm = make_norm(config)
        activation = "gelu" if config.mlp == "geglu" else "silu"
        if config.is_moe(layer):
            self.mlp = MoE(config.d_model, config.expert_dim, config.n_experts, config.experts_per_token,
                           norm_topk=config.norm_topk, shared_experts=config.shared_experts, activation=activation)
        elif config.mlp in ("swiglu", "geglu"):
            self.mlp = SwiGLU(config.d_model, config.hidden_dim, bias=config.bias, activation=activation)
        else:
            plain = SquaredReLUMLP if config.mlp == "relu2" else GELUMLP
            self.mlp = plain(config.d_model, config.hidden_dim, bias=config.bias)
        self.mlp_post_norm = make_norm(config) if config.post_norms else None
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding | None, kv_cache: KVCache | None,
                start_pos: int, *, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        attended = self.attn(self.attn_norm(x), rope, kv_cache, start_pos, input_pos=input_pos)  # (B, T, d)
        if self.attn_post_norm is not None:
            attended = self.attn_post_norm(attended)
        x = x + self.dropout(attended)  # (B, T, d)
        out = self.mlp(self.mlp_norm(x))  # (B, T, d)
        if self.mlp_post_norm is not None:
            out = self.mlp_post_norm(out)
        return x + self.dropout(out)  # (B, T, d)


class GPT(nn.Module):
    """Token ids (B, T) in, next-token logits (B, T, vocab_size) out."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        if config.position == "learned":
            self.position_embedding = nn.Embedding(config.context_length, config.d_model)
            self.rope = None
        else:
            self.position_embedding = None
            self.rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta, config.rope_scaling)
        # The sliding layers' own table, when they have a base of their own (Gemma 3: another base, no scaling)
        self.rope_local = None
        if config.position == "rope" and "sliding" in config.attention_types and config.rope_local_theta is not None:
            self.rope_local = RotaryEmbedding(config.head_dim, config.context_length, config.rope_local_theta)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        self.final_norm = make_norm(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.token_embedding.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init: each block adds two projections to the residual stream, so their
        # std shrinks with depth to keep the stream's variance from growing layer after layer.
        # zero_init_residual goes all the way: every block starts as the identity, and its
        # projections grow from zero with their first gradients (as the speedruns of small GPTs do).
        for name, param in self.named_parameters():
            if name.endswith(("attn.out_proj.weight", "mlp.proj.weight", "mlp.down.weight", "mlp.down",
                              "mlp.shared.down.weight")):  # the last two: a mixture of experts' and its shared MLP
                if config.zero_init_residual:
                    nn.init.zeros_(param)
                else:
                    nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, kv_caches: list[KVCache] | None = None,
                start_pos: int = 0, *, input_pos: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits for ids ``idx`` (B, T) sitting at positions start_pos..start_pos+T-1.

        ``input_pos`` (T,), the positions as a tensor, replaces start_pos (a compiled decoding step
        passes it, so that a new position is new data, not a new graph); (B, T) gives each row
        positions of its own (the rows of a continuous batch started at different times). With ``kv_caches`` (one per
        block, see ``make_kv_caches``) the ids' keys and values are written at their positions and
        attend to everything cached before them, so decoding feeds one new token at a time; the
        caller keeps the positions below the caches' length.
        last_only: the logits of the last position alone (B, 1, vocab_size), all that choosing the next token
        needs: a prompt's (B, T, vocab_size) are never made.
        With ``targets`` (B, T) of next-token ids (-100: skip), returns instead their mean
        cross-entropy, the same number as ``F.cross_entropy(logits.float().flatten(0, 1),
        targets.flatten())`` but computed chunk by chunk through whatever ``lm_head`` is
        (``llmscratch.model.losses.head_cross_entropy``): the (B, T, V) logits, the largest tensor of a
        training step, are never stored. A mixture-of-experts model in training mode adds its
        load-balancing loss times ``router_aux_weight``.
        Nothing is checked on the way, at every decoding step (the doors are the config and ``generate``): an id
        outside the vocabulary, or a position past the context of learned positions, is named when its lookup
        fails, at no cost to the calls that work; past RoPE's table the rotation fails.
        """
        x = self._embed(idx, start_pos, input_pos)  # (B, T, d)
        x = self.dropout(x)
        types = self.config.attention_types
        for i, block in enumerate(self.blocks):
            rope = self.rope_local if self.rope_local is not None and types[i] == "sliding" else self.rope
            x = block(x, rope, None if kv_caches is None else kv_caches[i], start_pos, input_pos=input_pos)
        x = self.final_norm(x)  # (B, T, d)
        if targets is not None:
            loss = head_cross_entropy(x.flatten(0, 1), self.lm_head, targets.flatten())  # ()
            if self.training and self.config.n_experts is not None and self.config.router_aux_weight:
                loss = loss + self.config.router_aux_weight * self.balance_loss()
            return loss
        return self.lm_head(x[:, -1:] if last_only else x)  # (B, T or 1, vocab_size)

    def balance_loss(self) -> torch.Tensor:
        """The experts' load-balancing loss of the last training forward, averaged over the MoE layers (1: even)."""
        losses = [block.mlp.aux_loss for block in self.blocks if isinstance(block.mlp, MoE)]
        return torch.stack(losses).mean()  # ()

    def _embed(self, idx: torch.Tensor, start_pos: int, input_pos: torch.Tensor | None) -> torch.Tensor:
        """Token (and learned position) embeddings of ``idx`` (B, T); a lookup that fails is a ValueError naming why."""
        seq_len = idx.size(1)
        try:  # diagnosed only when a lookup fails: nothing is spent on good ids (CUDA asserts on its device)
            x = self.token_embedding(idx)  # (B, T, d)
            if self.config.scale_embeddings:  # sqrt(d_model), rounded to the weights' dtype as Gemma does
                x = x * torch.tensor(self.config.d_model ** 0.5, dtype=x.dtype)
            if self.position_embedding is not None:
                positions = input_pos
                if positions is None:
                    positions = torch.arange(start_pos, start_pos + seq_len, device=idx.device)  # (T,)
                x = x + self.position_embedding(positions)  # (B, T, d)
            return x
        except IndexError:
            bad = idx[(idx < 0) | (idx >= self.config.vocab_size)]
            if bad.numel():
                raise ValueError(f"token id {bad[0].item()} is outside the model's vocabulary of "
                                 f"{self.config.vocab_size} ids (0..{self.config.vocab_size - 1}); were the ids "
                                 f"made by another tokenizer?") from None
            first, last = (start_pos, start_pos + seq_len - 1) if input_pos is None else (
                input_pos.min().item(), input_pos.max().item())
            raise ValueError(f"positions {first}..{last} exceed the model's "
                             f"context_length={self.config.context_length}") from None

    def make_kv_caches(self, batch_size: int, max_seq_len: int | None = None) -> list[KVCache]:
        """One empty cache per block, on this model's device and in its dtype.

        Each holds the key/value heads its block computes: all of them, or this rank's share under
        tensor parallelism (``llmscratch.training.parallel.apply_tp``). A block or attention module of
        your own without ``attn.n_kv_heads`` gets the config's count.
        """
        max_seq_len = self.config.context_length if max_seq_len is None else max_seq_len
        weight = self.token_embedding.weight
        return [
            KVCache(batch_size, max_seq_len, getattr(getattr(block, "attn", None), "n_kv_heads", self.config.kv_heads),
                    self.config.head_dim,
                    device=weight.device, dtype=weight.dtype)
            for block in self.blocks
        ]

    def num_params(self, include_embeddings: bool = True, active: bool = False) -> int:
        """Parameter count (a tied matrix once); without embeddings: minus token and position tables.

        With untied embeddings the output head is a real matrix multiply and stays counted.
        active: only the parameters one token goes through, which in a mixture of experts is k of its
        n_experts experts (the router and any shared expert whole).
        """
        total = count_parameters(self)
        if not include_embeddings:
            total -= self.token_embedding.weight.numel()
            if self.position_embedding is not None:
                total -= self.position_embedding.weight.numel()
        if active:
            for moe in (block.mlp for block in self.blocks if isinstance(block.mlp, MoE)):
                if not isinstance(moe.gate, nn.Parameter):  # quantized experts are buffers, never counted above
                    continue
                experts = sum(w.numel() for w in (moe.gate, moe.up, moe.down))
                total -= experts // moe.n_experts * (moe.n_experts - moe.k)
        return total

    def flops_per_token(self, seq_len: int | None = None, training: bool = True) -> int:
        """Matmul FLOPs per token: 2 per weight plus attention's QK^T and AV; x3 for training.

        The estimate of the PaLM paper (appendix B): every weight of a matrix multiply costs a
        multiply and an add per token; attention adds 2 * 2 * n_layers * seq_len * d_model. A mixture
        of experts counts the weights a token goes through (``num_params(active=True)``); a sliding
        layer attends over at most its window.
        """
        seq_len = self.config.context_length if seq_len is None else seq_len
        matmul_weights = self.num_params(include_embeddings=False, active=True)
        if self.config.tie_embeddings:
            matmul_weights += self.lm_head.weight.numel()  # the tied table is also the output head
        matmul_weights -= sum(p.numel() for n, p in self.named_parameters() if p.dim() < 2)
        attention_width = self.config.n_heads * self.config.head_dim  # d_model unless heads were pruned
        window = self.config.sliding_window or seq_len
        keys = sum(min(seq_len, window) if kind == "sliding" else seq_len for kind in self.config.attention_types)
        forward = 2 * matmul_weights + 4 * keys * attention_width
        return 3 * forward if training else forward


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    """Parameters of any model, each shared (tied) tensor once; optionally only the trainable ones."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)  # a tied weight once


def unwrap(model: nn.Module) -> nn.Module:
    """The plain model inside DistributedDataParallel and/or torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):  # torch.compile's OptimizedModule
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[nn.Module]:
    """``model`` in eval mode (dropout off) inside the block, then in the mode it had, even after an error."""
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
