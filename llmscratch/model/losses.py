"""Cross-entropy of a language model's output layer, computed chunk by chunk.

The plain way, ``F.cross_entropy(hidden @ weight.T, targets)``, stores the (N, V) logits, a
float32 copy under autocast, their log-softmax and, in the backward pass, a zero-filled (N, V)
gradient: with GPT-2's 50,257-token vocabulary and 8 x 1024 tokens, 1.6 GB per array. Here the
rows go through in chunks: each chunk's logits, log-softmax and gradient live in buffers
reused by every chunk, and the gradients of ``hidden`` and ``weight`` are finished during the
forward pass (the softmax is at hand then), so the backward pass only scales them. The matrix products are
the same three as the plain way; what goes is the (N, V) traffic and memory. The plain way stays
the reference: the tests hold this one to it.

The output layer, the "head", may be any module from hidden vectors to logits. A plain
``nn.Linear`` without bias is its weight alone, multiplied into the kept buffers
(``linear_cross_entropy``). Any other head (LoRA on the output layer, say) is called on each
chunk with autograd recording, and the chunk's logit gradient is sent back through it at once
(``head_cross_entropy``). The loss, its softmax gradient and the bookkeeping are one loop for both.
"""

import functools
import sys

import torch
from torch import nn

IGNORE_INDEX = -100  # the target that F.cross_entropy skips by default (padding, prompt tokens)


# Bytes of one float32 (rows, V) chunk buffer, by device. On a CPU a small chunk costs nothing and stays in
# cache. On a GPU small products waste it: on an H200 (the GPU check of 2026-11-27) gpt2-small's compiled
# bf16 training step of 16 x 1024 tokens took 55.2 ms with 64 MiB chunks (333 rows) and 40.5 ms with
# 1 GiB (4,096 rows), as fast as the full logits in the graph (41.3 ms) at 9.2 GiB of peak memory instead of 16.0.
CHUNK_BYTES = {"cpu": 64 * 2**20, "cuda": 2**30}
# The vocabulary inside the products is padded to a multiple of this, by device (1: as it is). On the H200,
# cuBLAS picked slow kernels for GPT-2's 50,257 rows: the same compiled step took 66.2 ms a step against
# 40.5 ms with the model's vocabulary padded to 50,304. The padded rows are zeros, their logits -inf.
PAD_VOCAB_TO = {"cpu": 1, "cuda": 64}


def default_chunk_rows(vocab_size: int, device_type: str = "cpu") -> int:
    """Rows per chunk so that one float32 (rows, vocab_size) buffer takes about CHUNK_BYTES of ``device_type``
    (a device without an entry: the CPU's)."""
    return max(16, CHUNK_BYTES.get(device_type, CHUNK_BYTES["cpu"]) // (4 * vocab_size))


class _LinearHead:
    """logits = hidden @ weight.T, the plain output layer: its products go into buffers kept for all chunks."""

    def __init__(self, weight: torch.Tensor, compute_dtype: torch.dtype):
        self.params = (weight,)
        self.compute_dtype = compute_dtype
        self.vocab_size = weight.size(0)

    def start(self, rows: int, want_hidden: bool, want_params: list[bool]) -> None:
        # Buffers reused by every chunk: a fresh (c, V) tensor per chunk costs page faults on CPU.
        weight = self.params[0]
        padding = -self.vocab_size % PAD_VOCAB_TO.get(weight.device.type, 1)
        if padding:  # cast and pad in one copy
            w = weight.new_zeros(self.vocab_size + padding, weight.size(1), dtype=self.compute_dtype)  # (V_padded, d)
            w[: self.vocab_size].copy_(weight)
        else:
            w = weight.to(self.compute_dtype)  # (V, d): one cast for all chunks
        self.weight = w
        acc_dtype = torch.promote_types(self.compute_dtype, torch.float32)
        self.mixed = self.compute_dtype != acc_dtype  # e.g. bf16 products, float32 sums
        self.logits_buf = torch.empty(rows, w.size(0), dtype=self.compute_dtype, device=w.device)  # (c, V)
        self.grad_weight = torch.zeros(w.shape, dtype=acc_dtype, device=w.device) if want_params[0] else None
        if self.mixed and self.grad_weight is not None:  # each chunk's product in compute_dtype, summed in acc_dtype
            self.part, self.part_acc = torch.empty_like(w), torch.empty_like(self.grad_weight)  # (V, d) each

    def inputs(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.to(self.compute_dtype)  # (N, d)

    def logits(self, h_c: torch.Tensor) -> torch.Tensor:
        logits = torch.mm(h_c, self.weight.t(), out=self.logits_buf[: h_c.size(0)])  # (c, V_padded)
        if logits.size(1) > self.vocab_size:
            logits[:, self.vocab_size:] = float("-inf")  # a padded id gets no probability, and no gradient
        return logits

    def backward(self, grad_logits: torch.Tensor, logits: torch.Tensor, h_c: torch.Tensor, keep_c: torch.Tensor,
                 grad_h: torch.Tensor | None) -> None:
        """Add the chunk's weight gradient; write its hidden gradient (c, d) into grad_h."""
        g = logits.copy_(grad_logits) if self.mixed else grad_logits  # (c, V) in compute_dtype
        # Ignored rows must contribute nothing: zero them in the (c, d) factors, not in g (c, V).
        keep_rows = keep_c[:, None].to(self.compute_dtype)  # (c, 1)
        if grad_h is not None:
            torch.mm(g, self.weight, out=grad_h).mul_(keep_rows)  # (c, d)
        if self.grad_weight is not None and self.mixed:  # a product in compute_dtype, summed in acc_dtype
            # Converting into a kept buffer first: a mixed-dtype add_ was 2.5x slower on CPU.
            self.grad_weight += self.part_acc.copy_(torch.mm(g.t(), h_c * keep_rows, out=self.part))  # (V, d)
        elif self.grad_weight is not None:
            self.grad_weight.addmm_(g.t(), h_c * keep_rows)  # (V, d) += (V, c) @ (c, d)

    def grads(self) -> list[torch.Tensor | None]:
        return [None if self.grad_weight is None else self.grad_weight[: self.vocab_size]]  # (V, d)


class _ModuleHead:
    """Any head module, called on each chunk under the caller's autocast; gradients through autograd."""

    def __init__(self, module: nn.Module, device_type: str):
        self.module = module
        self.params = tuple(module.parameters())
        self.autocast = (device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type))

    def start(self, rows: int, want_hidden: bool, want_params: list[bool]) -> None:
        self.want_hidden = want_hidden
        self.wanted = [p for p, want in zip(self.params, want_params) if want]
        # Summed in float32 at least, as the plain head's weight gradient is.
        self.sums = [torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32), device=p.device)
                     if want else None for p, want in zip(self.params, want_params)]

    def inputs(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # (N, d): the head casts what it needs, as when called directly

    def logits(self, h_c: torch.Tensor) -> torch.Tensor:
        self.h_c = h_c.detach().requires_grad_(self.want_hidden)
        device_type, dtype, enabled = self.autocast
        with torch.set_grad_enabled(self.want_hidden or bool(self.wanted)), \
                torch.autocast(device_type, dtype=dtype, enabled=enabled):
            return self.module(self.h_c)  # (c, V)

    def backward(self, grad_logits: torch.Tensor, logits: torch.Tensor, h_c: torch.Tensor, keep_c: torch.Tensor,
                 grad_h: torch.Tensor | None) -> None:
        """Send the chunk's logit gradient back through the head; add its parameters' gradients."""
        g = grad_logits.to(logits.dtype).mul_(keep_c[:, None])  # (c, V): ignored rows send nothing back
        inputs = ([self.h_c] if grad_h is not None else []) + self.wanted
        grads = list(torch.autograd.grad(logits, inputs, g, allow_unused=True))
        if grad_h is not None:
            grad_h.copy_(grads.pop(0))  # (c, d)
        wanted = iter(grads)
        for total in self.sums:
            if total is not None and (grad := next(wanted)) is not None:
                total += grad

    def grads(self) -> list[torch.Tensor | None]:
        return self.sums


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of a head's logits against ``targets``; gradients made in forward."""

    @staticmethod
    def forward(ctx, hidden, targets, head, chunk_rows, ignore_index, grad_enabled, *params):
        # needs_input_grad is True under no_grad too: grad_enabled says whether anyone will ask.
        want_hidden = grad_enabled and ctx.needs_input_grad[0]
        want_params = [grad_enabled and want for want in ctx.needs_input_grad[6:]]
        n_rows = hidden.size(0)
        n_chunks = max(1, -(-n_rows // chunk_rows))
        rows = max(1, -(-n_rows // n_chunks))  # equal chunks: no small leftover with a slow matrix product
        head.start(rows, want_hidden, want_params)
        h = head.inputs(hidden)  # (N, d)
        grad_hidden = torch.empty(h.shape, dtype=h.dtype, device=h.device) if want_hidden else None  # (N, d)
        total, count = _chunk_by_chunk(h, targets, head, rows, ignore_index, grad_hidden,
                                       want_hidden or any(want_params))
        ctx.save_for_backward(grad_hidden, count, *head.grads())
        ctx.dtypes = hidden.dtype, [p.dtype for p in params]
        return total / count  # a mean over no targets is nan, as F.cross_entropy's

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, count, *param_grads = ctx.saved_tensors
        scale = grad_output / count  # the mean's 1/N, times the incoming gradient
        hidden_dtype, param_dtypes = ctx.dtypes
        if grad_hidden is not None:
            grad_hidden = (grad_hidden * scale).to(hidden_dtype)
        param_grads = [None if g is None else (g * scale).to(dtype) for g, dtype in zip(param_grads, param_dtypes)]
        return grad_hidden, None, None, None, None, None, *param_grads


def _chunk_by_chunk(h, targets, head, rows, ignore_index, grad_hidden, want_grads):
    """The summed -log p(target) of the kept rows and their count; each chunk's gradients made on the way.

    h (N, d) and targets (N,); grad_hidden (N, d) receives the hidden gradients, the head keeps its own.
    """
    keep = targets != ignore_index  # (N,)
    safe_targets = targets.masked_fill(~keep, 0)  # (N,) any valid index; those rows are zeroed
    # Softmax and sums in float32 at least (float64 stays float64), whatever the product dtype.
    total = torch.zeros((), dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
    logp_buf = upcast_buf = None
    for start in range(0, h.size(0), rows):
        stop = min(start + rows, h.size(0))
        c = stop - start
        h_c, t_c, keep_c = h[start:stop], safe_targets[start:stop], keep[start:stop]  # (c, d), (c,), (c,)
        logits = head.logits(h_c)  # (c, V)
        if logp_buf is None:  # buffers reused by every chunk
            logp_buf = torch.empty(rows, logits.size(1), dtype=total.dtype, device=logits.device)  # (c, V)
            upcast_buf = torch.empty_like(logp_buf) if logits.dtype != total.dtype else None  # (c, V)
        scores = logits if upcast_buf is None else upcast_buf[:c].copy_(logits)  # (c, V) in total's dtype
        logp = torch.log_softmax(scores, dim=-1, out=logp_buf[:c])  # (c, V)
        picked = logp.gather(1, t_c[:, None]).squeeze(1)  # (c,) log-probability of each target
        total -= torch.where(keep_c, picked, 0.0).sum()
        if want_grads:
            # d(-log p_t)/d(logits) = softmax - one_hot(t); ignored rows contribute nothing.
            grad_logits = logp.exp_()  # (c, V), in place: the log-probabilities are no longer needed
            grad_logits[torch.arange(c, device=logits.device), t_c] -= 1.0
            head.backward(grad_logits, logits, h_c, keep_c, None if grad_hidden is None else grad_hidden[start:stop])
    return total, keep.sum()


def _apply(hidden: torch.Tensor, targets: torch.Tensor, head, chunk_rows: int, ignore_index: int) -> torch.Tensor:
    with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen by the head, explicitly
        # One target per row: reshaped, so a count that differs is torch's error here (nothing checked per step).
        targets = targets.reshape(hidden.size(0)).long()  # (N,)
        return _ChunkedCrossEntropy.apply(hidden, targets, head, chunk_rows, ignore_index,
                                          torch.is_grad_enabled(), *head.params)


def left_out_of_compile(fn):
    """``fn`` run eagerly even inside torch.compile, as ``torch.compiler.disable(fn)`` is, with the disabling done
    when a compiler first traces it: importing torch._dynamo takes about 2 s, which every script paid at start-up."""
    disabled = []

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            if not disabled:
                disabled.append(torch.compiler.disable(fn))
            return disabled[0](*args, **kwargs)
        return fn(*args, **kwargs)

    return call


# Left out of torch.compile graphs: the loop is already a few large kernels per chunk, and traced
# (the loop unrolled, the reused buffers functionalised) a compiled training step of the 6x384
# benchmark model got 13% slower on CPU and took 3x longer to compile.
@left_out_of_compile
def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         ignore_index: int = IGNORE_INDEX, chunk_rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits ``hidden @ weight.T`` against ``targets``, chunk by chunk.

    hidden (N, d), weight (V, d), targets (N,) of class ids (``ignore_index`` rows are skipped).
    Equals ``F.cross_entropy(hidden @ weight.T, targets, ignore_index=ignore_index)`` with the
    softmax in float32 (or float64 for float64 inputs); under autocast the matrix products run in
    the autocast dtype, as a Linear layer's would, and the gradients come back in the dtypes of
    hidden and weight. chunk_rows: rows per chunk (None: ``default_chunk_rows``, about 64 MiB of float32 logits
    on a CPU, 1 GiB on CUDA).
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    chunk_rows = default_chunk_rows(weight.size(0), hidden.device.type) if chunk_rows is None else chunk_rows
    return _apply(hidden, targets, _LinearHead(weight, compute_dtype), chunk_rows, ignore_index)


@left_out_of_compile
def head_cross_entropy(hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, *,
                       ignore_index: int = IGNORE_INDEX, chunk_rows: int | None = None) -> torch.Tensor:
    """Mean cross-entropy of the logits ``head(hidden)`` against ``targets``, chunk by chunk.

    head: any module mapping hidden (N, d) to logits (N, V). A plain ``nn.Linear`` without bias
    goes through ``linear_cross_entropy``; any other head is called on each chunk (under the
    caller's autocast), and it and ``hidden`` get the gradients of ``F.cross_entropy(head(hidden)
    .float(), targets, ignore_index=ignore_index)``, with the (N, V) logits never all stored.
    chunk_rows: rows per chunk (None: ``default_chunk_rows``, about 64 MiB of float32 logits on a CPU, 1 GiB on
    CUDA).
    """
    if type(head) is nn.Linear and head.bias is None:  # its weight is all there is to the head
        weight = head.weight
        dtensor = sys.modules.get("torch.distributed.tensor")  # (imported by whoever made a DTensor)
        if dtensor and isinstance(weight, dtensor.DTensor) and all(p.is_replicate() for p in weight.placements):
            # Tensor parallelism keeps the head whole on every rank (llmscratch.training.parallel): its local
            # tensor is the matrix, and its gradient goes back as the same replicated DTensor.
            weight = weight.to_local()
        return linear_cross_entropy(hidden, weight, targets, ignore_index=ignore_index, chunk_rows=chunk_rows)
    if chunk_rows is None:  # the head's output size: out_features, else its largest matrix's rows
        vocab_size = getattr(head, "out_features", max((p.size(0) for p in head.parameters() if p.dim() == 2),
                                                       default=hidden.size(1)))
        chunk_rows = default_chunk_rows(vocab_size, hidden.device.type)
    return _apply(hidden, targets, _ModuleHead(head, hidden.device.type), chunk_rows, ignore_index)
