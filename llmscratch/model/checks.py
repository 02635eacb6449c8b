"""What the model's parts and generation accept, checked once where a call enters.

The modules that compute (attention, RoPE, the model, the decoding loop) read like the notebooks that
build them: they call one of these at their door (a constructor, ``generate``) and trust their
arguments after that. Each check is a ValueError naming the bad value and what was expected.
A Hugging Face ``config.json`` is read through ``ConfigFields``, which names the file and the field.
"""

import math

import torch

__all__ = ["ConfigFields", "check_attention", "check_compile", "check_generation", "check_heads", "check_kv_cache",
           "check_prompt", "check_request", "check_rope", "check_sampling"]


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


# --------------------------------------------------------------------------- a Hugging Face config.json
# Ceilings far above any real model, low enough that a loop over the layers cannot run away before the weights
# are compared with the config (llmscratch.model.weights.load_hf checks every size against the tensors).
MAX_COUNT = 1 << 16  # layers, heads, experts
MAX_SIZE = (1 << 31) - 1  # widths, vocabulary, positions
REQUIRED = object()  # the default of a field the family cannot do without


class ConfigFields:
    """A Hugging Face ``config.json`` (``hf``, read from ``source``) taken one field at a time, each checked for
    its kind and range: a ValueError names the file, the field, what it must be and what it holds. A field that
    is absent or null takes its default."""

    def __init__(self, hf: dict, source: str, family: str, prefix: str = ""):
        self.hf, self.source, self.family, self.prefix = hf, source, family, prefix

    def within(self, name: str) -> "ConfigFields":
        """The fields of the object in field ``name`` (an empty one if absent), named ``name.field``."""
        return ConfigFields(self.mapping(name), self.source, self.family, f"{self.prefix}{name}.")

    def problem(self, name: str, must: str, value=None) -> ValueError:
        value = self.hf.get(name) if value is None else value
        return ValueError(f"{self.source}: {self.prefix}{name} must be {must}, got {value!r}")

    def has(self, name: str) -> bool:
        return self.hf.get(name) is not None

    def _get(self, name: str, default):
        value = self.hf.get(name)
        if value is None and default is REQUIRED:
            raise ValueError(f"{self.source} has no {self.prefix + name!r} entry, which a {self.family} config needs")
        return default if value is None else value

    def count(self, name: str, default=REQUIRED, low: int = 1, high: int = MAX_COUNT) -> int:
        """An integer in [low, high]: layers, heads, experts (``size`` for widths)."""
        value = self._get(name, default)
        if value is not None and (not _is_int(value) or not low <= value <= high):
            raise self.problem(name, f"an integer from {low} to {high:,}", value)
        return value

    def size(self, name: str, default=REQUIRED) -> int:
        """A width, a vocabulary or a number of positions: a positive integer."""
        return self.count(name, default, high=MAX_SIZE)

    def number(self, name: str, default=REQUIRED, zero: bool = False) -> float:
        """A finite number above 0 (at least 0 with ``zero``)."""
        value = self._get(name, default)
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
                or value < 0 or (value == 0 and not zero):
            raise self.problem(name, f"a finite number {'>= 0' if zero else 'above 0'}", value)
        return float(value)

    def flag(self, name: str, default: bool) -> bool:
        value = self._get(name, default)
        if not isinstance(value, bool):
            raise self.problem(name, "true or false", value)
        return value

    def text(self, name: str, default: str | None = None) -> str | None:
        value = self._get(name, default)
        if value is not None and not isinstance(value, str):
            raise self.problem(name, "a string", value)
        return value

    def mapping(self, name: str) -> dict:
        value = self._get(name, {})
        if not isinstance(value, dict):
            raise self.problem(name, "an object", value)
        return value

    def indices(self, name: str, n_layers: int) -> list[int]:
        """A list of layer indices below ``n_layers``."""
        value = self._get(name, [])
        if not isinstance(value, list) or not all(_is_int(i) and 0 <= i < n_layers for i in value):
            raise self.problem(name, f"a list of layer indices from 0 to {n_layers - 1}", value)
        return value

    def choices(self, name: str, n_layers: int, allowed: tuple[str, ...]) -> list[str] | None:
        """A list of one of ``allowed`` per layer, or None."""
        value = self._get(name, None)
        if value is not None and (not isinstance(value, list) or len(value) != n_layers
                                  or not all(isinstance(v, str) and v in allowed for v in value)):
            raise self.problem(name, f"a list of {n_layers} (one per layer) of {list(allowed)}", value)
        return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


