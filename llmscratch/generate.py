"""Text generation: greedy decoding and temperature / top-k / top-p sampling, with a KV cache.

``stream`` is the one decoding loop: it yields each new token as it is chosen. ``generate``
collects the whole continuation; ``stream_text`` and ``generate_text`` wrap both in a tokenizer.
The sampling steps (``top_k_filter``, ``top_p_filter``, ``sample_next_token``) are separate
functions so each can be shown and tested on its own.
"""

import codecs
import contextlib
from collections.abc import Iterator

import torch

from llmscratch.model import GPT, GPTConfig


# --------------------------------------------------------------------------- sampling
def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits (..., V) with all but the k largest of each row set to -inf (ties with the k-th kept)."""
    if k < 1:
        raise ValueError(f"top_k must be at least 1, got {k}")
    k = min(k, logits.size(-1))
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))  # (..., V)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep, in each row of logits (..., V), the smallest set of most likely tokens whose probability reaches p.

    The most likely token is always kept; tokens of equal probability are ranked by id.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {p}")
    if p == 1.0:  # all tokens: the float cumulative sum may reach 1.0 before the last one
        return logits
    probs = torch.softmax(logits.float(), dim=-1)  # (..., V)
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # (..., V) each
    mass = sorted_probs.cumsum(dim=-1)  # (..., V): mass of the top 1, 2, ... tokens
    # A token is dropped when the tokens ranked above it already reach p; the first never is.
    drop_sorted = torch.zeros_like(mass, dtype=torch.bool)  # (..., V)
    drop_sorted[..., 1:] = mass[..., :-1] >= p
    drop = drop_sorted.scatter(-1, order, drop_sorted)  # (..., V), back in vocabulary order
    return logits.masked_fill(drop, float("-inf"))


def _check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not temperature >= 0.0:  # also rejects NaN
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be at least 1 (or None), got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1] (or None), got {top_p}")


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One next-token id per row of logits (B, V): argmax if temperature == 0 (top_k, top_p unused), else a sample.

    Sampling divides the logits by the temperature, keeps the top_k, then the top_p nucleus,
    and draws from the softmax of what is left.
    """
    _check_sampling(temperature, top_k, top_p)
    if temperature == 0.0:
        return logits.argmax(dim=-1)  # (B,)
    logits = logits.float() / temperature  # (B, V); < 1 sharpens the distribution, > 1 flattens it
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    # Sample from probabilities: multinomial treats its input as unnormalised weights, so
    # log-probabilities (negative numbers) would be a silent, wrong distribution.
    probs = torch.softmax(logits, dim=-1)  # (B, V)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B,)


# --------------------------------------------------------------------------- decoding
def stream(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the next token of every row, a LongTensor (B,), for up to max_new_tokens steps.

    idx (B, T) holds equal-length prompts. Sampling: see ``sample_next_token``; greedy by default.
    eos_id: a row that produced it is finished, and from then on gets pad_id (default eos_id);
    the stream ends early once every row is finished. EOS tokens inside the prompt do not count.
    use_cache=True prefills the prompt in one forward, then feeds one token at a time while the
    sequence fits in ``context_length``. Past that point (and always with use_cache=False) each
    step re-runs the model on the last ``context_length`` tokens, a sliding window: slower, but it
    never runs out of context, and both settings choose the same tokens.
    vocab_size: choose only ids below it (default: any of the model's). For a model whose
    embedding is padded beyond its tokenizer's vocabulary (to a round size, for speed), pass
    the tokenizer's size so that no padding id, which decodes to nothing, is ever chosen.
    Arguments are checked at once; the model is in eval mode under inference_mode until the
    stream is exhausted or closed, then back in its previous mode.
    """
    _check_sampling(temperature, top_k, top_p)
    idx = _check_prompt(model, idx)
    pad_id = eos_id if pad_id is None else pad_id
    _check_request(model.config, max_new_tokens, eos_id, pad_id, vocab_size)

    def choose(logits: torch.Tensor) -> torch.Tensor:  # (B, V) -> (B,)
        return sample_next_token(logits[:, :vocab_size], temperature, top_k, top_p, generator)

    return _decode(model, idx, max_new_tokens, choose, eos_id, pad_id, use_cache)


def _check_prompt(model: GPT, idx: torch.Tensor) -> torch.Tensor:
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


def _check_request(config: GPTConfig, max_new_tokens: int, eos_id: int | None, pad_id: int | None,
                   vocab_size: int | None) -> None:
    """ValueError naming the value if the length, the special ids or vocab_size do not fit this model."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if vocab_size is not None and not 1 <= vocab_size <= config.vocab_size:
        raise ValueError(f"vocab_size={vocab_size} must be between 1 and the model's {config.vocab_size}")
    for name, value in (("eos_id", eos_id), ("pad_id", pad_id)):
        if value is not None and not 0 <= value < config.vocab_size:
            raise ValueError(f"{name}={value} is not a token id of this model (vocab_size={config.vocab_size})")
    if pad_id is not None and eos_id is None:
        raise ValueError(f"pad_id={pad_id} needs an eos_id: without one no row ever finishes")


@torch.inference_mode()  # on a generator function, torch enters the mode around each step only
def _decode(model, idx, max_new_tokens, choose, eos_id, pad_id, use_cache) -> Iterator[torch.Tensor]:
    was_training = model.training
    model.eval()  # dropout off
    try:
        yield from _decode_steps(model, idx, max_new_tokens, choose, eos_id, pad_id, use_cache)
    finally:
        model.train(was_training)


def _decode_steps(model, idx, max_new_tokens, choose, eos_id, pad_id, use_cache) -> Iterator[torch.Tensor]:
    """The decoding loop of ``stream``, without its checks; choose(logits (B, V)) picks the ids (B,)."""
    if max_new_tokens == 0:
        return
    batch_size, prompt_len = idx.shape
    context_length = model.config.context_length
    total_len = prompt_len + max_new_tokens
    tokens = torch.empty(batch_size, total_len, dtype=torch.long, device=idx.device)  # (B, T + n)
    tokens[:, :prompt_len] = idx
    # The cache holds every position the model is fed while the sequence fits in its context
    # (the last new token is never fed back); sized once, so it is never reallocated.
    cache_len = min(total_len - 1, context_length) if use_cache and prompt_len <= context_length else 0
    kv_caches = model.make_kv_caches(batch_size, cache_len) if cache_len else None
    if kv_caches is not None:
        logits = model(idx, kv_caches)[:, -1]  # (B, V): only the last position predicts a new token
    else:
        logits = model(idx[:, -context_length:])[:, -1]  # (B, V)
    finished = torch.zeros(batch_size, dtype=torch.bool, device=idx.device)  # (B,)
    for length in range(prompt_len + 1, total_len + 1):  # tokens so far, the new one included
        next_ids = choose(logits)  # (B,)
        if eos_id is not None:
            next_ids = next_ids.masked_fill(finished, pad_id)  # (B,)
            finished |= next_ids == eos_id
        yield next_ids
        tokens[:, length - 1] = next_ids
        if length == total_len or (eos_id is not None and finished.all()):
            return
        if length <= cache_len:  # the new token's position, length - 1, is inside the cache
            logits = model(next_ids[:, None], kv_caches, start_pos=length - 1)[:, -1]  # (B, V)
        else:  # a sliding window over the last context_length tokens
            logits = model(tokens[:, max(0, length - context_length):length])[:, -1]  # (B, V)


def generate(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
) -> torch.Tensor:
    """The prompts idx (B, T) followed by their continuations: a LongTensor (B, T + n).

    Arguments as for ``stream``. n == max_new_tokens unless every row reached eos_id sooner; then
    n is the step at which the last row finished, and earlier-finished rows are padded with pad_id.
    """
    new_tokens = list(stream(model, idx, max_new_tokens, temperature, top_k, top_p, eos_id, pad_id,
                             use_cache, generator, vocab_size))
    if not new_tokens:
        return idx.clone()
    # Outside inference_mode: the result is an ordinary tensor, free to be modified in place.
    return torch.cat([idx.to(new_tokens[0].device), torch.stack(new_tokens, dim=1)], dim=1)  # (B, T + n)


# --------------------------------------------------------------------------- text
def text_to_ids(text: str, tokenizer, device: torch.device | str | None = None) -> torch.Tensor:
    """Token ids (1, T) of text; special tokens written in the text (``<|endoftext|>``) are allowed.

    tokenizer: a ``BPETokenizer`` or a tiktoken ``Encoding``.
    """
    ids = tokenizer.encode(text, allowed_special="all")
    return torch.tensor([ids], dtype=torch.long, device=device)  # (1, T)


def ids_to_text(ids: torch.Tensor, tokenizer) -> str:
    """The text of one sequence of ids, shape (T,) or (1, T)."""
    if ids.dim() == 2 and ids.size(0) == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(f"ids_to_text decodes one sequence, shape (T,) or (1, T); got {tuple(ids.shape)}")
    return tokenizer.decode(ids.tolist())


def stream_text(model: GPT, tokenizer, prompt: str, max_new_tokens: int, **options) -> Iterator[str]:
    """Yield the continuation of prompt piece by piece, each piece whole UTF-8 characters.

    Options as for ``stream``; generation stops at eos_id, which is not part of the text. Only ids
    the tokenizer knows are chosen (see ``vocab_size``), unless options say otherwise.
    """
    idx = text_to_ids(prompt, tokenizer)
    options.setdefault("vocab_size", min(tokenizer.n_vocab, model.config.vocab_size))
    # One token may hold half of a multi-byte character: hold bytes back until it is complete.
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    eos_id = options.get("eos_id")
    # closing: a caller that stops reading early also ends the stream (and restores the model's mode).
    with contextlib.closing(stream(model, idx, max_new_tokens, **options)) as steps:
        for next_id in steps:
            token_id = int(next_id[0])
            if token_id == eos_id:  # the last token: with one row, the stream ends at EOS
                break
            if piece := decoder.decode(tokenizer.decode_bytes([token_id])):
                yield piece
    if tail := decoder.decode(b"", final=True):
        yield tail


def generate_text(model: GPT, tokenizer, prompt: str, max_new_tokens: int, **options) -> str:
    """prompt followed by its generated continuation (up to eos_id, excluded); options as for ``stream``."""
    return prompt + "".join(stream_text(model, tokenizer, prompt, max_new_tokens, **options))
