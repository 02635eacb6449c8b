"""Cross-entropy of a language model's output layer, computed chunk by chunk.

The plain way, ``F.cross_entropy(hidden @ weight.T, targets)``, stores the (N, V) logits, a
float32 copy under autocast, their log-softmax and, in the backward pass, a zero-filled (N, V)
gradient: with GPT-2's 50,257-token vocabulary and 8 x 1024 tokens, 1.6 GB per array. Here the
rows go through in chunks: each chunk's logits, log-softmax and gradient live in buffers
reused by every chunk, and the gradients of ``hidden`` and ``weight`` are finished during the
forward pass (the softmax is at hand then), so the backward pass only scales them. The matrix products are
the same three as the plain way; what goes is the (N, V) traffic and memory. The plain way stays
the reference: the tests hold this one to it.
"""

import torch

IGNORE_INDEX = -100  # the target that F.cross_entropy skips by default (padding, prompt tokens)


def default_chunk_rows(vocab_size: int, budget_bytes: int = 64 * 2**20) -> int:
    """Rows per chunk so that one float32 (rows, vocab_size) buffer takes about ``budget_bytes``."""
    return max(16, budget_bytes // (4 * vocab_size))


class _LinearCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``hidden @ weight.T`` against ``targets``; gradients made in forward."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk_rows, compute_dtype, ignore_index, grad_enabled):
        n_rows = hidden.size(0)
        h = hidden.to(compute_dtype)  # (N, d)
        w = weight.to(compute_dtype)  # (V, d): one cast for all chunks
        # needs_input_grad is True under no_grad too: grad_enabled says whether anyone will ask.
        want_hidden = grad_enabled and ctx.needs_input_grad[0]
        want_weight = grad_enabled and ctx.needs_input_grad[1]
        grad_hidden = torch.empty(h.shape, dtype=compute_dtype, device=h.device) if want_hidden else None  # (N, d)
        # Softmax and sums in float32 at least (float64 stays float64), whatever the product dtype.
        acc_dtype = torch.promote_types(compute_dtype, torch.float32)
        grad_weight = torch.zeros(w.shape, dtype=acc_dtype, device=w.device) if want_weight else None
        n_chunks = max(1, -(-n_rows // chunk_rows))
        rows = max(1, -(-n_rows // n_chunks))  # equal chunks: no small leftover with a slow matrix product
        mixed = compute_dtype != acc_dtype  # e.g. bf16 products, float32 softmax
        # Buffers reused by every chunk: a fresh (c, V) tensor per chunk costs page faults on CPU.
        logits_buf = torch.empty(rows, w.size(0), dtype=compute_dtype, device=w.device)  # (c, V)
        logp_buf = torch.empty(rows, w.size(0), dtype=acc_dtype, device=w.device)  # (c, V)
        upcast_buf = torch.empty_like(logp_buf) if mixed else None  # (c, V)
        if mixed and grad_weight is not None:  # each chunk's product in compute_dtype, then in acc_dtype
            part_buf, part_acc = torch.empty_like(w), torch.empty_like(grad_weight)  # (V, d) each
        keep = targets != ignore_index  # (N,)
        safe_targets = targets.masked_fill(~keep, 0)  # (N,) any valid index; those rows are zeroed
        total = torch.zeros((), dtype=acc_dtype, device=w.device)
        for start in range(0, n_rows, rows):
            stop = min(start + rows, n_rows)
            c = stop - start
            h_c, t_c, keep_c = h[start:stop], safe_targets[start:stop], keep[start:stop]  # (c, d), (c,), (c,)
            logits = torch.mm(h_c, w.t(), out=logits_buf[:c])  # (c, V)
            scores = upcast_buf[:c].copy_(logits) if mixed else logits  # (c, V) in acc_dtype
            logp = torch.log_softmax(scores, dim=-1, out=logp_buf[:c])  # (c, V)
            picked = logp.gather(1, t_c[:, None]).squeeze(1)  # (c,) log-probability of each target
            total -= torch.where(keep_c, picked, 0.0).sum()
            if grad_hidden is None and grad_weight is None:
                continue
            # d(-log p_t)/d(logits) = softmax - one_hot(t); ignored rows contribute nothing.
            grad_logits = logp.exp_()  # (c, V), in place: the log-probabilities are no longer needed
            grad_logits[torch.arange(c, device=w.device), t_c] -= 1.0
            g = logits.copy_(grad_logits) if mixed else grad_logits  # (c, V) in compute_dtype
            # Ignored rows must contribute nothing: zero them in the (c, d) factors, not in g (c, V).
            keep_rows = keep_c[:, None].to(compute_dtype)  # (c, 1)
            if grad_hidden is not None:
                torch.mm(g, w, out=grad_hidden[start:stop]).mul_(keep_rows)  # (c, d)
            if grad_weight is not None and mixed:  # a product in compute_dtype, summed in acc_dtype
                # Converting into a kept buffer first: a mixed-dtype add_ was 2.5x slower on CPU.
                grad_weight += part_acc.copy_(torch.mm(g.t(), h_c * keep_rows, out=part_buf))  # (V, d)
            elif grad_weight is not None:
                grad_weight.addmm_(g.t(), h_c * keep_rows)  # (V, d) += (V, c) @ (c, d)
        count = keep.sum()
        ctx.save_for_backward(grad_hidden, grad_weight, count)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        return total / count  # a mean over no targets is nan, as F.cross_entropy's

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight, count = ctx.saved_tensors
        scale = grad_output / count  # the mean's 1/N, times the incoming gradient
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * scale).to(ctx.hidden_dtype)
        if grad_weight is not None:
            grad_weight = (grad_weight * scale).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


# Left out of torch.compile graphs: the loop is already a few large kernels per chunk, and traced
# (the loop unrolled, the reused buffers functionalised) a compiled training step of the 6x384
# benchmark model got 13% slower on CPU and took 3x longer to compile.
@torch.compiler.disable
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = IGNORE_INDEX, chunk_rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` against ``targets``, chunk by chunk.

    hidden (N, d), weight (V, d), targets (N,) of class ids (``ignore_index`` rows are skipped).
    Equals ``F.cross_entropy(hidden @ weight.T, targets, ignore_index=ignore_index)`` with the
    softmax in float32 (or float64 for float64 inputs); under autocast the matrix products run in
    the autocast dtype, as a Linear layer's would, and the gradients come back in the dtypes of
    hidden and weight. chunk_rows: rows per chunk (None: about 64 MiB of float32 logits).
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.size(1) != weight.size(1):
        raise ValueError(f"need hidden (N, d) and weight (V, d); got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"targets must have shape ({hidden.size(0)},), got {tuple(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer class ids, got dtype {targets.dtype}")
    if chunk_rows is not None and chunk_rows < 1:
        raise ValueError(f"chunk_rows must be a positive integer, got {chunk_rows}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    chunk_rows = default_chunk_rows(weight.size(0)) if chunk_rows is None else chunk_rows
    with torch.autocast(device_type, enabled=False):  # the dtypes are chosen above, explicitly
        return _LinearCrossEntropy.apply(hidden, weight, targets.long(), chunk_rows, compute_dtype, ignore_index,
                                         torch.is_grad_enabled())
