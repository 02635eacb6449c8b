"""Text generation: greedy decoding and temperature / top-k / top-p sampling, with a KV cache.

``stream`` is the one decoding loop: it yields each new token as it is chosen. ``generate``
collects the whole continuation; ``stream_text`` and ``generate_text`` wrap both in a tokenizer.
The sampling steps (``top_k_filter``, ``top_p_filter``, ``sample_next_token``) are separate
functions so each can be shown and tested on its own. With the cache, decoding is ``prefill``
(the prompt in one forward) then ``decode_one_token`` again and again: a step whose shapes never
change, so that ``compile=True`` compiles it once for a whole generation (gpt-fast's design).
"""

import codecs
import contextlib
import functools
from collections.abc import Callable, Iterator

import torch

from llmscratch.model.attention import KVCache
from llmscratch.model.checks import check_generation
from llmscratch.model.decode_kernels import OneRowMath
from llmscratch.model.gpt import GPT, evaluating
from llmscratch.model.paged import PagedKVCache, feed


# --------------------------------------------------------------------------- sampling
# These steps run once per token and check nothing: ``stream`` checks the sampling settings once,
# when a generation starts (``llmscratch.model.checks``), and each step trusts them.
def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits (..., V) with all but the k >= 1 largest of each row set to -inf (ties with the k-th kept)."""
    k = min(k, logits.size(-1))
    kth_largest = torch.topk(logits, k, dim=-1).values[..., -1:]  # (..., 1)
    return logits.masked_fill(logits < kth_largest, float("-inf"))  # (..., V)


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep, in each row of logits (..., V), the smallest set of most likely tokens whose probability reaches p.

    p is in (0, 1]. The most likely token is always kept; tokens of equal probability are ranked by id.
    """
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


def sample_next_token(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One next-token id per row of logits (B, V): argmax if temperature == 0 (top_k, top_p unused), else a sample.

    Sampling divides the logits by the temperature, keeps the top_k, then the top_p nucleus,
    and draws from the softmax of what is left. A temperature so small that the division
    overflows samples among the largest logits only: the limit as the temperature goes to 0.
    The settings are those ``llmscratch.model.checks.check_sampling`` accepts.
    """
    if temperature == 0.0:
        return logits.argmax(dim=-1)  # (B,)
    probs = sampling_probs(logits, temperature, top_k, top_p)  # (B, V)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)  # (B,)


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> torch.Tensor:
    """The probabilities (B, V) that ``sample_next_token`` draws from, for a temperature > 0.

    Speculative decoding (``llmscratch.deployment.speculative``) needs them whole, for the target and the draft alike.
    """
    # < 1 sharpens the distribution, > 1 flattens it. Shifted so that the largest logit is 0, in
    # float64 where any float temperature is a nonzero number: a tiny one sends the others to
    # -inf, never inf / inf = NaN (softmax is unchanged by the shift). MPS has no float64: there the
    # temperature is kept at float32's smallest normal number at least, which does the same.
    logits = scaled_logits(logits, temperature, torch.float32 if logits.device.type == "mps" else torch.float64)
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    if top_p is not None:
        logits = top_p_filter(logits, top_p)
    # Sample from probabilities: multinomial treats its input as unnormalised weights, so
    # log-probabilities (negative numbers) would be a silent, wrong distribution.
    return torch.softmax(logits, dim=-1)  # (B, V)


def scaled_logits(logits: torch.Tensor, temperature: float, wide: torch.dtype) -> torch.Tensor:
    """logits / temperature in float32, shifted so that the largest is 0, computed in ``wide`` (float64, or float32
    on a device without float64, with the temperature kept at float32's smallest normal number at least)."""
    if wide == torch.float32:
        temperature = max(temperature, torch.finfo(torch.float32).tiny)
    shifted = logits.to(wide) - logits.to(wide).amax(dim=-1, keepdim=True)  # (B, V), all <= 0
    return (shifted / temperature).float()  # (B, V)


# --------------------------------------------------------------------------- decoding
def stream(
    model: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_id: int | None = None,
    pad_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
    vocab_size: int | None = None,
    compile: bool | str = False,
    samples_per_prompt: int = 1,
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
    compile: run the cached decoding step through ``torch.compile`` (compiled on the first call,
    reused after; see ``compiled_decode_one_token``). The same tokens, faster once compiled.
    compile="cuda-graphs" (a model on a CUDA device only) also replays the compiled step as one
    CUDA graph: one launch per token instead of one per kernel, which is most of a small model's
    batch-1 step on a GPU.
    samples_per_prompt: continue each prompt that many times (rows b * n .. b * n + n - 1 are prompt
    b's), as idx.repeat_interleave(n, dim=0) would, but with each prompt prefilled once and its keys and
    values copied to its samples' rows: what sampling several answers to one prompt (``llmscratch.alignment.grpo``)
    needs.
    Arguments are checked at once; the model is in eval mode under inference_mode until the
    stream is exhausted or closed, then back in its previous mode.
    """
    pad_id = eos_id if pad_id is None else pad_id
    idx = check_generation(model, idx, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                           eos_id=eos_id, pad_id=pad_id, vocab_size=vocab_size, compile=compile,
                           samples_per_prompt=samples_per_prompt)
    device = model.token_embedding.weight.device

    def choose(logits: torch.Tensor) -> torch.Tensor:  # (B, V) -> (B,)
        return sample_next_token(logits[:, :vocab_size], temperature, top_k, top_p, generator)

    cuda_graphs = compile == "cuda-graphs"
    step = compiled_decode_one_token(cuda_graphs, device) if compile else decode_one_token
    return _decode(model, idx, max_new_tokens, choose, eos_id, pad_id, use_cache, step, cuda_graphs, samples_per_prompt)


def prefill(model: GPT, idx: torch.Tensor, kv_caches: list[KVCache]) -> torch.Tensor:
    """Run the prompts idx (B, T) through the model once, filling the caches' first T positions.

    Returns the next-token logits (B, V) of the last position. The prompt's length varies from
    call to call, so this step is left to the eager kernels.
    """
    return model(idx, kv_caches)[:, -1]  # (B, V): only the last position predicts a new token


def prefilled_cache(model: GPT, idx: torch.Tensor, samples: int, length: int) -> tuple[PagedKVCache, torch.Tensor]:
    """A paged cache holding the prompts idx (B, T), each run once and copied to its ``samples`` rows, with every
    block up to ``length`` positions given out in row order (``PagedKVCache.freeze``), so that attention reads each
    row in place. Returns it and the next-token logits (B * samples, V), row b * samples + j for sample j of prompt
    b. (The rows copy the prompt rather than share its blocks: a shared block would have to be gathered at every
    step, which costs more than one copy; the engine, whose sequences come and go, shares them.)"""
    prompts = list(range(idx.size(0)))
    rows = [(b, j) for b in prompts for j in range(samples)]
    cache = PagedKVCache(model, sequences=len(rows), max_model_len=length, lookahead=length, prefix_sharing=False,
                         forget=False)
    for row in rows:
        cache.add(row, ())
        cache.reserve(row, length)
    logits = feed(model, cache, [(b, 0) for b in prompts], idx.tolist(), last_only=True)[:, -1]  # (b, V)
    for b, j in rows:
        if j:
            cache.copy_sequence((b, 0), (b, j))
    cache.freeze(rows, length)
    return cache, logits.repeat_interleave(samples, dim=0)  # (B, V)


def decode_one_token(model: GPT, token: torch.Tensor, input_pos: torch.Tensor,
                     kv_caches: list[KVCache]) -> torch.Tensor:
    """Feed one token per row, token (B, 1), at position input_pos (1,); its next-token logits (B, V).

    Every step has the same shapes (the caches are read whole, masked to the filled positions),
    so ``torch.compile`` compiles it once for a whole generation.
    """
    return model(token, kv_caches, input_pos=input_pos)[:, -1]  # (B, V)


def _decode_one_token_as_plain_math(model: GPT, token: torch.Tensor, input_pos: torch.Tensor,
                                    kv_caches: list[KVCache]) -> torch.Tensor:
    """``decode_one_token`` with a CPU's one-row products and one-query attention as plain math (``OneRowMath``)."""
    with OneRowMath():
        return decode_one_token(model, token, input_pos, kv_caches)  # (B, V)


def compiled_decode_one_token(cuda_graphs: bool = False,
                              device: torch.device | str = "cpu") -> Callable[..., torch.Tensor]:
    """``decode_one_token`` through ``torch.compile``, made once per process (per variant) and shared by all models.

    The graph is traced on the first call and reused while the model's structure and the
    caches' shapes stay the same; fullgraph=True turns any graph break into an error. The model is
    an argument, so its weights stay inputs of the graph (freezing, asked for here, does not make
    them constants: seen in inductor's output code with torch 2.13).

    device: where the model is. On a CPU with more than one thread (``torch.get_num_threads()``
    when the step is asked for), what is traced is ``decode_one_token`` under ``OneRowMath``: a
    batch-1 step's products and attention become inductor's own loops, spread over the threads,
    where the BLAS kernel for one row uses one (llmscratch/model/decode_kernels.py; with one thread
    BLAS is as fast, and stays). Inductor is also told to compute each norm's output once
    (``realize_acc_reads_threshold``) rather than again inside every product that reads it. On a
    GPU the products stay cuBLAS's, and what compiling saves is the work between them.

    cuda_graphs: also record the compiled step as a CUDA graph and replay it (inductor's
    "triton.cudagraphs" option, which mode="reduce-overhead" sets). A graph reads and writes fixed
    addresses: the weights stay put, ``_decode`` marks the caches static, the token and input_pos
    are copied into the graph's inputs at each replay, and a step's logits are overwritten by the
    next replay (``_decode`` chooses the token first). No freezing here: its pass drops those
    static marks (torch 2.13), and inductor then skips the graphs of a step that writes its
    inputs. A new generation's caches have new addresses: its first step records the graph again.
    """
    plain_math = torch.device(device).type == "cpu" and torch.get_num_threads() > 1
    return _compile_decode_one_token(bool(cuda_graphs), plain_math and not cuda_graphs)


@functools.cache  # keyed by the variant alone: compiled_decode_one_token() and (False) share one function
def _compile_decode_one_token(cuda_graphs: bool, plain_math: bool) -> Callable[..., torch.Tensor]:
    if cuda_graphs:
        return torch.compile(decode_one_token, fullgraph=True, options={"triton.cudagraphs": True})
    if plain_math:
        return torch.compile(_decode_one_token_as_plain_math, fullgraph=True,
                             options={"freezing": True, "realize_acc_reads_threshold": 1})
    return torch.compile(decode_one_token, fullgraph=True, options={"freezing": True})


@torch.inference_mode()  # on a generator function, torch enters the mode around each step only
def _decode(model, idx, max_new_tokens, choose, eos_id, pad_id, use_cache, step,
            cuda_graphs: bool = False, samples: int = 1) -> Iterator[torch.Tensor]:
    """The decoding loop of ``stream``, on arguments it checked; choose(logits (B, V)) picks the ids (B,).

    step: ``decode_one_token`` or its compiled version; cuda_graphs: it replays a CUDA graph, which
    writes the caches where they were when it was recorded. The model is in eval mode (dropout off) throughout.
    """
    if max_new_tokens == 0:
        return
    with evaluating(model):
        prompts, prompt_len = idx.shape
        batch_size = prompts * samples
        context_length = model.config.context_length
        total_len = prompt_len + max_new_tokens
        # The cache holds every position the model is fed while the sequence fits in its context
        # (the last new token is never fed back); sized once, so it is never reallocated.
        cache_len = min(total_len - 1, context_length) if use_cache and prompt_len <= context_length else 0
        # Past the cache, each step reads the last context_length tokens: only those are kept (a stream may be
        # as long as asked, its memory stays one window).
        slides = total_len - 1 > cache_len
        recent = idx[:, -context_length:].repeat_interleave(samples, dim=0)  # (B, <= context_length)
        if cache_len:
            cache, logits = prefilled_cache(model, idx, samples, cache_len)  # (B, V)
            if cuda_graphs:  # the graph writes the blocks where they are, never a copy
                for group in cache.groups:
                    for tensor in group.keys + group.values:
                        torch._dynamo.mark_static_address(tensor)
            kv_caches = cache.layers
        else:
            logits = model(idx[:, -context_length:])[:, -1].repeat_interleave(samples, dim=0)  # (B, V)
        input_pos = torch.tensor([prompt_len], device=idx.device)  # (1,): where the next token is fed
        finished = torch.zeros(batch_size, dtype=torch.bool, device=idx.device)  # (B,)
        for length in range(prompt_len + 1, total_len + 1):  # tokens so far, the new one included
            next_ids = choose(logits)  # (B,)
            if eos_id is not None:
                next_ids = next_ids.masked_fill(finished, pad_id)  # (B,)
                finished |= next_ids == eos_id
            yield next_ids
            if slides:
                recent = torch.cat([recent, next_ids[:, None]], dim=1)[:, -context_length:]  # (B, <= context_length)
            if length == total_len or (eos_id is not None and finished.all()):
                return
            if length <= cache_len:  # the new token's position, length - 1 == input_pos, is inside the cache
                logits = step(model, next_ids[:, None], input_pos, kv_caches)  # (B, V)
                input_pos += 1  # in place: a compiled step sees the same input tensor every time
            else:  # a sliding window over the last context_length tokens (eager: its length varies at first)
                logits = model(recent)[:, -1]  # (B, V)


def generate(model: GPT, idx: torch.Tensor, max_new_tokens: int, **options) -> torch.Tensor:
    """The prompts idx (B, T) followed by their continuations: a LongTensor (B, T + n).

    Options as for ``stream`` (temperature, top_k, top_p, eos_id, pad_id, use_cache, generator,
    vocab_size, compile). n == max_new_tokens unless every row reached eos_id sooner; then n is
    the step at which the last row finished, and earlier-finished rows are padded with pad_id.
    """
    new_tokens = list(stream(model, idx, max_new_tokens, **options))
    idx = idx.repeat_interleave(options.get("samples_per_prompt", 1), dim=0)  # (B, T): a row per sample
    if not new_tokens:
        return idx.clone()
    # Outside inference_mode: the result is an ordinary tensor, free to be modified in place.
    return torch.cat([idx.to(new_tokens[0].device), torch.stack(new_tokens, dim=1)], dim=1)  # (B, T + n)


# --------------------------------------------------------------------------- text
def prompt_ids(tokenizer, prompt: str) -> list[int]:
    """The ids a prompt is read as: special tokens written in it encoded as such (``with_bos``)."""
    return with_bos(tokenizer, tokenizer.encode(prompt, allowed_special="all"))


def with_bos(tokenizer, ids: list[int]) -> list[int]:
    """ids after the id a sequence starts with, where the tokenizer has one (``bos_id``: Llama 3's
    "<|begin_of_text|>", Gemma's "<bos>") and ids do not start with it already."""
    bos = getattr(tokenizer, "bos_id", None)
    return [bos, *ids] if bos is not None and ids[:1] != [bos] else ids


def stream_text(model: GPT, tokenizer, prompt: str, max_new_tokens: int, **options) -> Iterator[str]:
    """Yield the continuation of prompt piece by piece, each piece whole UTF-8 characters.

    tokenizer: a ``BPETokenizer`` or a tiktoken ``Encoding``; special tokens written in the prompt
    (``<|endoftext|>``) are encoded as such. Options as for ``stream``; generation stops at eos_id,
    which is not part of the text. Only ids the tokenizer knows are chosen (see ``vocab_size``),
    unless options say otherwise.
    """
    idx = torch.tensor([prompt_ids(tokenizer, prompt)])  # (1, T); "<|endoftext|>" is one id
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
