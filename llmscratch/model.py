"""The GPT model: one class that is GPT-2 or a Llama-style decoder, chosen by its config.

GPT-2: LayerNorm, GELU MLP, learned positions, multi-head attention with biases, tied
embeddings. Llama-style: RMSNorm, SwiGLU MLP, RoPE, grouped-query attention, no biases.
Both are a stack of pre-norm blocks: ``x = x + attention(norm(x)); x = x + mlp(norm(x))``.
"""

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmscratch.attention import KVCache, MultiHeadAttention, check_heads
from llmscratch.config import check_fields, positive, positive_int, setting
from llmscratch.losses import head_cross_entropy
from llmscratch.norm import RMSNorm
from llmscratch.rope import RotaryEmbedding


@dataclass(frozen=True)
class GPTConfig:
    """Every size and design choice of a GPT; each field is checked when the config is made (``setting``)."""

    vocab_size: int = setting(50257, "token ids the model knows", positive_int)
    context_length: int = setting(1024, "the most positions one sequence may hold", positive_int)
    d_model: int = setting(768, "width of the residual stream", positive_int)
    n_layers: int = setting(12, "transformer blocks", positive_int)
    n_heads: int = setting(12, "query heads per attention layer", positive_int)
    n_kv_heads: int | None = setting(None, "key/value heads; None: as many as n_heads (multi-head attention)",
                                     positive_int)
    d_ff: int | None = setting(None, "MLP hidden size; None: 4 * d_model", positive_int)
    norm: str = setting("layernorm", "normalisation layer", choices=("layernorm", "rmsnorm"))
    mlp: str = setting("gelu", "feed-forward layer; relu2: GELU's shape with max(0, x)^2",
                       choices=("gelu", "swiglu", "relu2"))
    position: str = setting("learned", "learned position embeddings or rotary ones (RoPE)",
                            choices=("learned", "rope"))
    rope_theta: float = setting(10_000.0, "RoPE's base: the slowest pair turns once every ~2 pi theta positions",
                                positive)
    qkv_bias: bool = setting(True, "bias on the query/key/value projection")
    bias: bool = setting(True, "bias on every other linear layer and on LayerNorm")
    tie_embeddings: bool = setting(True, "the output head reuses the token embedding matrix")
    qk_norm: bool = setting(False, "RMS-normalise each head's queries and keys (learned gains) before RoPE")
    zero_init_residual: bool = setting(False, "attention's out_proj and the MLP's last layer start at zero")
    norm_eps: float = setting(1e-5, "epsilon of the norms", positive)
    dropout: float = setting(0.0, "dropout on embeddings, attention weights and residual branches",
                             lambda value: None if 0 <= value < 1 else "must be in [0, 1)")
    fused_attention: bool = setting(True, "scaled_dot_product_attention; False: the explicit math")
    head_size: int | None = setting(None, "each head's width; None: d_model // n_heads (a model with heads pruned "
                                          "away keeps their width and has fewer of them, llmscratch.prune)",
                                    positive_int)

    def __post_init__(self):
        check_fields(self)  # each field on its own: kind, range, choices
        if self.head_size is None:
            check_heads(self.d_model, self.n_heads, self.kv_heads, width_name="d_model")
        else:
            check_heads(self.n_heads * self.head_size, self.n_heads, self.kv_heads, width_name="n_heads * head_size")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head size, got d_model/n_heads = {self.head_dim}")

    def __repr__(self) -> str:
        # head_size only where it is set (a pruned model's config), so the usual configs print as they always have
        shown = [f for f in dataclasses.fields(self) if f.name != "head_size" or self.head_size is not None]
        return f"GPTConfig({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads if self.head_size is None else self.head_size

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    @classmethod
    def from_preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named configuration (see ``PRESETS``), with any field overridden."""
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - fields)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {unknown}; the fields are {sorted(fields)}")
        return cls(**{**PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_LLAMA = dict(norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False)
PRESETS: dict[str, dict] = {
    # OpenAI GPT-2 (2019): 124M / 355M / 774M / 1558M parameters with tied embeddings.
    "gpt2-small": dict(d_model=768, n_layers=12, n_heads=12),
    "gpt2-medium": dict(d_model=1024, n_layers=24, n_heads=16),
    "gpt2-large": dict(d_model=1280, n_layers=36, n_heads=20),
    "gpt2-xl": dict(d_model=1600, n_layers=48, n_heads=25),
    # Llama-style models small enough to train on a laptop CPU (vocabulary set by the tokenizer).
    "llama-tiny": dict(_LLAMA, vocab_size=4096, context_length=256, d_model=128, n_layers=4,
                       n_heads=4, n_kv_heads=2, d_ff=384),
    "llama-mini": dict(_LLAMA, vocab_size=4096, context_length=256, d_model=256, n_layers=6,
                       n_heads=8, n_kv_heads=4, d_ff=768),
    "llama-small": dict(_LLAMA, vocab_size=4096, context_length=512, d_model=512, n_layers=8,
                        n_heads=8, n_kv_heads=4, d_ff=1536),
    # TinyLlama 1.1B's shape (a plain Llama 2 architecture: its weights load with load_hf).
    "tinyllama-1.1b": dict(_LLAMA, vocab_size=32000, context_length=2048, d_model=2048,
                           n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632, tie_embeddings=False),
    # Llama 3 8B's shape (2024): a model for many GPUs (FSDP and tensor parallelism, ch04), not for a CPU.
    "llama3-8b": dict(_LLAMA, vocab_size=128256, context_length=8192, d_model=4096, n_layers=32,
                      n_heads=32, n_kv_heads=8, d_ff=14336, rope_theta=500_000.0, tie_embeddings=False),
}


class GELUMLP(nn.Module):
    """GPT-2's feed-forward layer: expand, GELU (tanh approximation), project back.

    squared_relu: max(0, x)^2 instead of GELU (the speedruns' choice; as sparse as ReLU, smooth at 0).
    """

    def __init__(self, d_model: int, hidden: int, bias: bool, squared_relu: bool = False):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.proj = nn.Linear(hidden, d_model, bias=bias)
        self.squared_relu = squared_relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(x)  # (B, T, hidden)
        hidden = F.relu(hidden).square() if self.squared_relu else F.gelu(hidden, approximate="tanh")
        return self.proj(hidden)  # (B, T, d_model)


class SwiGLU(nn.Module):
    """Llama's feed-forward layer: a SiLU-activated gate multiplies a second projection."""

    def __init__(self, d_model: int, hidden: int, bias: bool):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=bias)
        self.up = nn.Linear(d_model, hidden, bias=bias)
        self.down = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # (B, T, d_model)


def make_norm(config: GPTConfig) -> nn.Module:
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, eps=config.norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.norm_eps, bias=config.bias)


class Block(nn.Module):
    """One transformer block: pre-norm attention and pre-norm MLP, each added to the residual."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attn_norm = make_norm(config)
        self.attn = MultiHeadAttention(
            config.d_model, config.d_model, config.n_heads, config.kv_heads, qkv_bias=config.qkv_bias,
            out_bias=config.bias, dropout=config.dropout, fused=config.fused_attention,
            qk_norm=config.qk_norm, norm_eps=config.norm_eps, head_dim=config.head_size,
        )
        self.mlp_norm = make_norm(config)
        if config.mlp == "swiglu":
            self.mlp = SwiGLU(config.d_model, config.hidden_dim, bias=config.bias)
        else:
            self.mlp = GELUMLP(config.d_model, config.hidden_dim, bias=config.bias, squared_relu=config.mlp == "relu2")
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, rope: RotaryEmbedding | None, kv_cache: KVCache | None,
                start_pos: int, *, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        attended = self.attn(self.attn_norm(x), rope, kv_cache, start_pos, input_pos=input_pos)  # (B, T, d)
        x = x + self.dropout(attended)  # (B, T, d)
        return x + self.dropout(self.mlp(self.mlp_norm(x)))  # (B, T, d)


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
            self.rope = RotaryEmbedding(config.head_dim, config.context_length, config.rope_theta)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
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
            if name.endswith(("attn.out_proj.weight", "mlp.proj.weight", "mlp.down.weight")):
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
                targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits for ids ``idx`` (B, T) sitting at positions start_pos..start_pos+T-1.

        ``input_pos`` (T,), the positions as a tensor, replaces start_pos (a compiled decoding step
        passes it, so that a new position is new data, not a new graph); (B, T) gives each row
        positions of its own (the rows of a continuous batch started at different times). With ``kv_caches`` (one per
        block, see ``make_kv_caches``) the ids' keys and values are written at their positions and
        attend to everything cached before them, so decoding feeds one new token at a time; the
        caller keeps the positions below the caches' length.
        With ``targets`` (B, T) of next-token ids (-100: skip), returns instead their mean
        cross-entropy, the same number as ``F.cross_entropy(logits.float().flatten(0, 1),
        targets.flatten())`` but computed chunk by chunk through whatever ``lm_head`` is
        (``llmscratch.losses.head_cross_entropy``): the (B, T, V) logits, the largest tensor of a
        training step, are never stored.
        Nothing is checked on the way, at every decoding step: an id outside the vocabulary or a
        position past the context is named when its lookup fails, at no cost to the calls that work.
        """
        x = self._embed(idx, start_pos, input_pos)  # (B, T, d)
        x = self.dropout(x)
        for i, block in enumerate(self.blocks):
            x = block(x, self.rope, None if kv_caches is None else kv_caches[i], start_pos, input_pos=input_pos)
        x = self.final_norm(x)  # (B, T, d)
        if targets is not None:
            return head_cross_entropy(x.flatten(0, 1), self.lm_head, targets.flatten())  # ()
        return self.lm_head(x)  # (B, T, vocab_size)

    def _embed(self, idx: torch.Tensor, start_pos: int, input_pos: torch.Tensor | None) -> torch.Tensor:
        """Token (and learned position) embeddings of ``idx`` (B, T); a lookup that fails is a ValueError naming why."""
        seq_len = idx.size(1)
        try:  # diagnosed only when a lookup fails: nothing is spent on good ids (CUDA asserts on its device)
            x = self.token_embedding(idx)  # (B, T, d)
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
        tensor parallelism (``llmscratch.parallel.apply_tp``). A block or attention module of
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

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count (a tied matrix once); without embeddings: minus token and position tables.

        With untied embeddings the output head is a real matrix multiply and stays counted.
        """
        total = count_parameters(self)
        if not include_embeddings:
            total -= self.token_embedding.weight.numel()
            if self.position_embedding is not None:
                total -= self.position_embedding.weight.numel()
        return total

    def flops_per_token(self, seq_len: int | None = None, training: bool = True) -> int:
        """Matmul FLOPs per token: 2 per weight plus attention's QK^T and AV; x3 for training.

        The estimate of the PaLM paper (appendix B): every weight of a matrix multiply costs a
        multiply and an add per token; attention adds 2 * 2 * n_layers * seq_len * d_model.
        """
        seq_len = self.config.context_length if seq_len is None else seq_len
        matmul_weights = self.num_params(include_embeddings=False)
        if self.config.tie_embeddings:
            matmul_weights += self.lm_head.weight.numel()  # the tied table is also the output head
        matmul_weights -= sum(p.numel() for n, p in self.named_parameters() if p.dim() < 2)
        attention_width = self.config.n_heads * self.config.head_dim  # d_model unless heads were pruned
        forward = 2 * matmul_weights + 4 * self.config.n_layers * seq_len * attention_width
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
