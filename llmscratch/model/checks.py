"""What the model's parts and generation accept, checked once where a call enters.

The modules that compute (attention, RoPE, the model, the decoding loop) read like the notebooks that
build them: they call one of these at their door (a constructor, ``generate``) and trust their
arguments after that. Each check is a ValueError naming the bad value and what was expected.
"""

import torch

__all__ = ["check_attention", "check_compile", "check_generation", "check_heads", "check_kv_cache", "check_prompt",
           "check_request", "check_rope", "check_sampling"]


# --------------------------------------------------------------------------- the model's parts
def check_heads(d_out: int, n_heads: int, n_kv_heads: int, width_name: str = "d_out") -> None:
    """ValueError unless the heads split d_out evenly and the query heads fall into equal groups."""
    if d_out % n_heads:
        raise ValueError(f"{width_name}={d_out} is not divisible by n_heads={n_heads}")
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")


def check_attention(d_in: int, d_out: int, n_heads: int, n_kv_heads: int, head_dim: int | None,
                    dropout: float) -> None:
    """``MultiHeadAttention``'s sizes: positive, heads that split evenly, dropout in [0, 1)."""
    if min(d_in, d_out, n_heads, n_kv_heads, head_dim or 1) <= 0:
        raise ValueError(f"sizes must be positive; got d_in={d_in}, d_out={d_out}, "
                         f"n_heads={n_heads}, n_kv_heads={n_kv_heads}, head_dim={head_dim}")
    check_heads(d_out if head_dim is None else n_heads * head_dim, n_heads, n_kv_heads)
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1); got dropout={dropout}")


def check_kv_cache(batch_size: int, max_seq_len: int, n_kv_heads: int, head_dim: int) -> None:
    """``KVCache``'s sizes: all positive."""
    if min(batch_size, max_seq_len, n_kv_heads, head_dim) <= 0:
        raise ValueError(f"KVCache sizes must be positive; got batch_size={batch_size}, max_seq_len={max_seq_len}, "
                         f"n_kv_heads={n_kv_heads}, head_dim={head_dim}")


def check_rope(head_dim: int, max_seq_len: int) -> None:
    """``RotaryEmbedding``'s sizes: an even head width (RoPE turns pairs) and a positive table length."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"RoPE rotates pairs of dimensions, so head_dim must be even and positive; "
                         f"got head_dim={head_dim}")
    if max_seq_len <= 0:
        raise ValueError(f"max_seq_len must be positive; got max_seq_len={max_seq_len}")


# --------------------------------------------------------------------------- generation
def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError naming the setting unless temperature >= 0, top_k >= 1 and 0 < top_p <= 1 (or None)."""
    if not temperature >= 0.0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1 (or None), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (or None), got {top_p}")


def check_compile(compile: bool | str, device: torch.device) -> None:
    """ValueError naming the value unless compile is False, True or "cuda-graphs", the last with a model on CUDA."""
    if not (isinstance(compile, bool) or compile == "cuda-graphs"):
        raise ValueError(f"compile must be False, True or 'cuda-graphs', got {compile!r}")
    if compile == "cuda-graphs" and device.type != "cuda":
        raise ValueError(f"compile='cuda-graphs' needs a model on a CUDA device; this one is on {device}")


def check_prompt(model, idx: torch.Tensor) -> torch.Tensor:
    """idx as (B, T) token ids on the model's device, or ValueError naming what is wrong."""
    if not isinstance(idx, torch.Tensor) or idx.dtype != torch.long:
        raise ValueError(f"idx must be a LongTensor of token ids, got {getattr(idx, 'dtype', type(idx))}")
    if idx.dim() != 2 or idx.size(0) < 1 or idx.size(1) < 1:
        raise ValueError(f"idx must have shape (batch, prompt_length) with both >= 1, got {tuple(idx.shape)}")
    vocab_size = model.config.vocab_size
    low, high = idx.min().item(), idx.max().item()
    if low < 0 or high >= vocab_size:
        raise ValueError(f"idx holds ids {low}..{high}, outside 0..{vocab_size - 1} (vocab_size={vocab_size})")
    return idx.to(model.token_embedding.weight.device)


def check_request(config, max_new_tokens: int, eos_id: int | None, pad_id: int | None,
                  vocab_size: int | None) -> None:
    """ValueError naming the value if the length, the special ids or vocab_size do not fit this model (``config``,
    a ``GPTConfig``)."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if vocab_size is not None and not 1 <= vocab_size <= config.vocab_size:
        raise ValueError(f"vocab_size={vocab_size} must be between 1 and the model's {config.vocab_size}")
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        if value is not None and not 0 <= value < config.vocab_size:
            raise ValueError(f"{name}={value} is not a token id of this model (vocab_size={config.vocab_size})")
    if pad_id is not None and eos_id is None:
        raise ValueError(f"pad_id={pad_id} needs an eos_id: without one no row ever finishes")


def check_generation(model, idx: torch.Tensor, max_new_tokens: int, *, temperature: float, top_k: int | None,
                     top_p: float | None, eos_id: int | None, pad_id: int | None, vocab_size: int | None,
                     compile: bool | str, samples_per_prompt: int) -> torch.Tensor:
    """Everything ``generate`` and ``stream`` are given, checked before the first token; returns the prompt on
    the model's device."""
    check_sampling(temperature, top_k, top_p)
    check_compile(compile, model.token_embedding.weight.device)
    idx = check_prompt(model, idx)
    check_request(model.config, max_new_tokens, eos_id, pad_id, vocab_size)
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be at least 1, got {samples_per_prompt}")
    return idx
