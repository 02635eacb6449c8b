"""What a GPT is: ``GPTConfig``, every size and design choice, checked once when the config is made, and the
named ``PRESETS`` (GPT-2, Llama-style, today's open families).

The config is the model's door: every field and every combination is checked when it is made (with
``llmscratch.model.checks`` for the heads), and the modules that build the model (attention, RoPE, the block)
trust the config they are given.
"""

import dataclasses
from dataclasses import dataclass

from llmscratch.config import ConfigError, check_fields, positive, positive_int, setting
from llmscratch.model.checks import check_heads

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
                                          "away keeps their width and has fewer of them, llmscratch.deployment.prune)",
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
    # Mixture of experts (llmscratch.model.moe): each token goes through its top-k of n_experts MLPs
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
