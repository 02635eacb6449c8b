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
from torch import nn

from llmscratch.attention import KVCache, MultiHeadAttention, check_heads
from llmscratch.config import ConfigError, check_fields, positive, positive_int, setting
from llmscratch.losses import head_cross_entropy
from llmscratch.mlp import GELUMLP, SwiGLU
from llmscratch.moe import MoE
from llmscratch.norm import RMSNorm
from llmscratch.rope import RotaryEmbedding


LAYER_TYPES = ("full", "sliding")


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
    mlp: str = setting("gelu", "feed-forward layer; relu2: GELU's shape with max(0, x)^2; geglu: SwiGLU's shape "
                               "with the tanh GELU as its gate (Gemma)", choices=("gelu", "swiglu", "relu2", "geglu"))
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
    # Gemma 3's choices: sliding-window layers, norms after the sublayers too, scaled embeddings
    sliding_window: int | None = setting(None, "keys a sliding layer's query sees: its own position and the "
                                               "window - 1 before it", positive_int)
    layer_types: tuple[str, ...] | None = setting(
        None, "each layer's attention, 'full' or 'sliding'; None: all sliding with a sliding_window, else all full",
        lambda value: None if isinstance(value, tuple) and set(value) <= set(LAYER_TYPES) else
        f"must be a tuple of {list(LAYER_TYPES)}")
    rope_local_theta: float | None = setting(None, "RoPE's base in the sliding layers, which then rotate with a "
                                                   "table of their own, unscaled (Gemma 3: 10,000 there, 1,000,000 "
                                                   "in the full ones); None: every layer shares one table", positive)
    rope_scaling: float = setting(1.0, "linear RoPE scaling: positions divided by this, in every layer that uses "
                                       "rope_theta's table (Gemma 3 4B and larger: 8, its full layers)", positive)
    post_norms: bool = setting(False, "also normalise each sublayer's output before it joins the residual "
                                      "(Gemma 2 and 3)")
    scale_embeddings: bool = setting(False, "multiply the token embeddings by sqrt(d_model) (Gemma)")
    query_scale: float | None = setting(None, "attention scores are divided by sqrt(this); None: the head size "
                                              "(Gemma's query_pre_attn_scalar)", positive)
    # Mixture of experts (llmscratch.moe): each token goes through its top-k of n_experts MLPs
    n_experts: int | None = setting(None, "experts in each mixture-of-experts MLP; None: a dense MLP",
                                    lambda value: None if value >= 2 else "must be at least 2")
    experts_per_token: int = setting(2, "experts each token is sent to (the router's top k)", positive_int)
    d_expert: int | None = setting(None, "hidden size of each expert; None: d_ff", positive_int)
    shared_experts: int = setting(0, "experts every token goes through besides its routed ones (one MLP of "
                                     "shared_experts x d_expert)", lambda value: None if value >= 0 else "must be >= 0")
    norm_topk: bool = setting(True, "rescale each token's top-k routing weights to sum to 1 (Mixtral, Qwen3-MoE)")
    dense_layers: tuple[int, ...] = setting((), "layers that keep a dense MLP in a mixture-of-experts model",
                                            lambda value: None if isinstance(value, tuple) and all(
                                                isinstance(i, int) and i >= 0 for i in value) else
                                            "must be a tuple of layer indices")
    router_aux_weight: float = setting(0.01, "weight of the experts' load-balancing loss in the training loss",
                                       lambda value: None if value >= 0 else "must be >= 0")

    def __post_init__(self):
        for name in ("layer_types", "dense_layers"):  # a JSON list (a checkpoint's config) is kept as a tuple
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        check_fields(self)  # each field on its own: kind, range, choices
        if self.head_size is None:
            check_heads(self.d_model, self.n_heads, self.kv_heads, width_name="d_model")
        else:
            check_heads(self.n_heads * self.head_size, self.n_heads, self.kv_heads, width_name="n_heads * head_size")
        if self.position == "rope" and self.head_dim % 2:
            raise ValueError(f"RoPE needs an even head size, got d_model/n_heads = {self.head_dim}")
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise ConfigError("layer_types", f"must name one type per layer ({self.n_layers})", self.layer_types)
        if "sliding" in self.attention_types and self.sliding_window is None:
            raise ConfigError("sliding_window", "must be set for layer_types with 'sliding' layers", None)
        if self.n_experts is not None:
            if self.mlp not in ("swiglu", "geglu"):
                raise ConfigError("mlp", "must be swiglu or geglu in a mixture-of-experts model (its experts are "
                                         "gated MLPs)", self.mlp)
            if self.experts_per_token > self.n_experts:
                raise ConfigError("experts_per_token", f"must be at most n_experts={self.n_experts}",
                                  self.experts_per_token)
            if any(i >= self.n_layers for i in self.dense_layers):
                raise ConfigError("dense_layers", f"must be layer indices below n_layers={self.n_layers}",
                                  self.dense_layers)

    def __repr__(self) -> str:
        # The fields added after GPT-2 and Llama (head_size and on) only where they differ from their default, so
        # the usual configs print as they always have.
        names = [f.name for f in dataclasses.fields(self)]
        later = names[names.index("head_size"):]
        shown = [f for f in dataclasses.fields(self) if f.name not in later or getattr(self, f.name) != f.default]
        return f"GPTConfig({', '.join(f'{f.name}={getattr(self, f.name)!r}' for f in shown)})"

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Each layer's attention, 'full' or 'sliding'."""
        if self.layer_types is not None:
            return self.layer_types
        return ("full" if self.sliding_window is None else "sliding",) * self.n_layers

    def is_moe(self, layer: int) -> bool:
        """Whether block ``layer`` has a mixture of experts for its MLP."""
        return self.n_experts is not None and layer not in self.dense_layers

    @property
    def expert_dim(self) -> int:
        return self.hidden_dim if self.d_expert is None else self.d_expert

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
    # Today's open families (load_hf reads their checkpoints; section 9 of chapter 3): Qwen3 0.6B (2025),
    # QK-norm and heads wider than d_model / n_heads ...
    "qwen3-0.6b": dict(_LLAMA, vocab_size=151936, context_length=40960, d_model=1024, n_layers=28, n_heads=16,
                       n_kv_heads=8, head_size=128, d_ff=3072, qk_norm=True, rope_theta=1_000_000.0, norm_eps=1e-6),
    # ... Gemma 3 1B (2025): 5 sliding layers of 512 keys to each global one, post-norms, GeGLU ...
    "gemma3-1b": dict(_LLAMA, mlp="geglu", vocab_size=262144, context_length=32768, d_model=1152, n_layers=26,
                      n_heads=4, n_kv_heads=1, head_size=256, d_ff=6912, qk_norm=True, post_norms=True,
                      scale_embeddings=True, sliding_window=512,
                      layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(26)),
                      rope_theta=1_000_000.0, rope_local_theta=10_000.0, norm_eps=1e-6),
    # ... and Qwen3-30B-A3B (2025): 128 experts, 8 per token
    "qwen3-30b-a3b": dict(_LLAMA, vocab_size=151936, context_length=40960, d_model=2048, n_layers=48, n_heads=32,
                          n_kv_heads=4, head_size=128, d_ff=6144, qk_norm=True, n_experts=128, experts_per_token=8,
                          d_expert=768, rope_theta=1_000_000.0, norm_eps=1e-6, tie_embeddings=False,
                          router_aux_weight=0.008),
}


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
            self.mlp = GELUMLP(config.d_model, config.hidden_dim, bias=config.bias, squared_relu=config.mlp == "relu2")
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
        training step, are never stored. A mixture-of-experts model in training mode adds its
        load-balancing loss times ``router_aux_weight``.
        Nothing is checked on the way, at every decoding step: an id outside the vocabulary or a
        position past the context is named when its lookup fails, at no cost to the calls that work.
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
        return self.lm_head(x)  # (B, T, vocab_size)

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
