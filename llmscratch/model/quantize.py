"""Weight-only quantization: int8 per output channel, int4 in groups along the input features.

A weight matrix (out_features, in_features) is stored as small integers and a float scale per row
(int8) or per group of ``group_size`` inputs of a row (int4, two values packed in a byte), and turned
back into floats, ``q * scale``, when the layer runs. Both schemes are symmetric: 0 stays exactly 0.
The activations, the embedding and the norms stay in full precision; the output head is int8 under
either scheme (it is the largest matrix of a small model, and the one whose errors every logit shares).

Decoding one token reads every weight once, so its speed is the bytes it reads. Dequantizing a
whole matrix to multiply it would read the int8 bytes and write and read the float32 ones, slower
than not quantizing at all. Instead a product of a few rows multiplies by the integers where they
lie: it reads the stored bytes as 32-bit words and takes each value out of its word with shifts.
For that, a layer stores its values in *word order* (``to_word_order``): within each block of eight
words, value n of word i is column ``n * 8 + i`` of the block, so the activations each value meets
are contiguous too. ``word_product`` writes the product in PyTorch, to read; the layers run the same
loop in C (``llmscratch/kernels/word_product.c``, built on first use by ``llmscratch.native``), eagerly and
inside ``torch.compile`` alike, as the custom operator ``llmscratch::word_product``. Off the CPU the C
kernels play no part: a layer dequantizes inside its product (``dequantized_product``), gpt-fast's and
torchao's form, which ``torch.compile`` fuses.

A mixture of experts keeps its stacked experts (E, out, in) in ``QuantizedExperts``: each expert's rows
scaled as a matrix's are, dequantized when a token chooses the expert. Only the routers stay in float.
"""
import copy
import ctypes
import functools
import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

from llmscratch import native
from llmscratch.model.moe import MoE

SCHEMES = {"int8": 127, "int4": 7}  # the largest |q| of each: a row's (or group's) largest |w| maps to it
VALUES_PER_WORD = {"int8": 4, "int4": 8}  # values in one 32-bit word of the stored layout
WORDS = 8  # words per block of the word order: one 256-bit vector register of int32
HEAD_SCHEME = "int8"
# Up to this many rows the kernel multiplies by the stored integers; for more, one dequantized matrix
# and a matrix product (which reuses each weight across the rows) is faster.
KERNEL_ROWS = 8
# For more rows, the C kernel dequantizes this many weight rows at a time into a buffer the allocator
# reuses: a whole fresh float32 matrix would cost more in first-touch page faults than in arithmetic.
CHUNK_ROWS = 256


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): int8 (out, in) in [-127, 127] and float32 (out,), with weight ~ q * scales[:, None]."""
    weight = weight.detach().float()
    # a row of zeros gets the smallest normal scale, not 0 (0 / 0) or a subnormal (0 where denormals flush)
    scales = (weight.abs().amax(dim=1) / SCHEMES["int8"]).clamp(min=torch.finfo(torch.float32).tiny)  # (out,)
    q = torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scales


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight (out, in) that int8 ``q`` and its row scales stand for."""
    return q.float() * scales[:, None]


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed, scales): uint8 (out, in / 2), two 4-bit values a byte, and float32 (out, in / group_size).

    Each group of ``group_size`` consecutive inputs of a row gets its own scale, so one outlier spoils
    only its group. q in [-7, 7] is stored as q + 8; column 2j in the low half of byte j, 2j + 1 in the high.
    """
    q, scales = _int4_values(weight, group_size)
    return pack_int4(q), scales


def _int4_values(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): q as int8 (out, in) in [-7, 7], before packing."""
    out_features, in_features = weight.shape
    _check_int4_shape(in_features, group_size)
    groups = weight.detach().float().reshape(out_features, in_features // group_size, group_size)
    scales = (groups.abs().amax(dim=2) / SCHEMES["int4"]).clamp(min=torch.finfo(torch.float32).tiny)  # (out, n_groups)
    q = torch.round(groups / scales[..., None]).clamp(-7, 7).reshape(out_features, in_features)
    return q.to(torch.int8), scales


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values (out, in) in [-7, 7] as bytes (out, in / 2): q + 8, column 2j low, 2j + 1 high."""
    stored = (q + 8).to(torch.uint8)  # 1 .. 15
    return stored[:, 0::2] | (stored[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The int8 values (out, in) in [-7, 7] that ``pack_int4`` packed."""
    out_features, half = packed.shape
    return torch.stack([packed & 0x0F, packed >> 4], dim=2).reshape(out_features, 2 * half).to(torch.int8) - 8


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 weight (out, in) that packed int4 values and their group scales stand for."""
    q = unpack_int4(packed).float()  # (out, in)
    out_features, in_features = q.shape
    group_size = in_features // scales.shape[1]
    return (q.reshape(out_features, -1, group_size) * scales[..., None]).reshape(out_features, in_features)


def _check_int4_shape(in_features: int, group_size: int) -> None:
    if group_size < 2 or group_size % 2:
        raise ValueError(f"int4 group_size must be an even number of at least 2 (two values a byte), got {group_size}")
    if in_features % group_size:
        raise ValueError(f"int4 group_size {group_size} does not divide the layer's {in_features} input features; "
                         f"choose one that does (e.g. {_divisor(in_features)})")


def _divisor(n: int) -> int:
    """The largest even divisor of n up to 128 (a usable group size), or 2."""
    return max((g for g in range(2, min(n, 128) + 1, 2) if n % g == 0), default=2)


# --------------------------------------------------------------------------- the word order and its product
def to_word_order(q: torch.Tensor, per_word: int) -> torch.Tensor:
    """q (out, in) with its columns reordered within each block of ``WORDS * per_word`` columns.

    In the result, column ``i * per_word + n`` of a block (value n of word i, once packed) is column
    ``n * WORDS + i`` of the block in ``q``: the values of a word meet activations ``WORDS`` apart, so
    value n of every word in a block meets one contiguous run of ``WORDS`` activations.
    """
    out_features, in_features = q.shape
    blocks = q.reshape(out_features, in_features // (WORDS * per_word), per_word, WORDS)  # (out, nb, n, i)
    return blocks.transpose(2, 3).reshape(out_features, in_features)  # (out, nb, i, n) flattened


def from_word_order(stored: torch.Tensor, per_word: int) -> torch.Tensor:
    """The inverse of ``to_word_order``: columns back in their natural order."""
    out_features, in_features = stored.shape
    blocks = stored.reshape(out_features, in_features // (WORDS * per_word), WORDS, per_word)  # (out, nb, i, n)
    return blocks.transpose(2, 3).reshape(out_features, in_features)


def word_order_fits(scheme: str, in_features: int, group_size: int | None) -> bool:
    """Whether a layer can be stored in word order: whole blocks, and (int4) each run of WORDS in one group."""
    block = WORDS * VALUES_PER_WORD[scheme]
    fits = in_features % block == 0 and sys.byteorder == "little"
    if scheme == "int4":
        fits = fits and group_size % WORDS == 0 and (group_size % block == 0 or block % group_size == 0)
    return fits


def word_product(x: torch.Tensor, stored: torch.Tensor, scales: torch.Tensor, scheme: str) -> torch.Tensor:
    """x (..., in) times the weight that word-ordered ``stored`` and ``scales`` stand for: (..., out).

    The same as ``F.linear(x, dequantized weight)``, written as integer shifts, a multiply and a sum:
    the loop of ``llmscratch/kernels/word_product.c``, in PyTorch, to read and to test the kernel against. Run
    eagerly it builds weight-sized temporaries; the layers call the kernel (``native_word_product``),
    or, where it cannot be built, let ``torch.compile`` fuse this into one loop for a one-row product.
    """
    per_word = VALUES_PER_WORD[scheme]
    out_features, in_features = stored.size(0), stored.size(1) * (2 if scheme == "int4" else 1)
    n_blocks = in_features // (WORDS * per_word)
    words = stored.view(torch.int32).view(out_features, n_blocks, WORDS)  # (out, nb, i)
    runs = x.float().reshape(*x.shape[:-1], 1, n_blocks, per_word, WORDS)  # (..., 1, nb, n, i)
    total = 0
    for n in range(per_word):
        if scheme == "int8":  # byte n of each word, sign-extended: shift it to the top, then back down
            values = ((words << (24 - 8 * n)) >> 24).float()  # (out, nb, i)
        else:  # nibble n, stored as q + 8
            values = (((words >> (4 * n)) & 0xF) - 8).float() * _run_scales(scales, n, n_blocks)[..., None]
        total = total + runs[..., n, :] * values  # (..., out, nb, i)
    out = total.sum((-2, -1))  # (..., out)
    return (out * scales if scheme == "int8" else out).to(x.dtype)


def _run_scales(scales: torch.Tensor, n: int, n_blocks: int) -> torch.Tensor:
    """The int4 scale of run n of each block: (out, nb), from group scales (out, in / group_size)."""
    out_features, n_groups = scales.shape
    block = WORDS * VALUES_PER_WORD["int4"]
    if n_groups <= n_blocks:  # a group spans whole blocks: one scale for the block
        return scales[:, :, None].expand(out_features, n_groups, n_blocks // n_groups).reshape(out_features, n_blocks)
    per_block = n_groups // n_blocks  # a block spans whole groups: run n lies in group n * WORDS // group_size
    return scales.view(out_features, n_blocks, per_block)[:, :, n * WORDS * per_block // block]


@functools.cache
def _kernels() -> ctypes.CDLL | None:
    """The compiled word products (with their argument types set), or None where they cannot be built.

    The library must first give PyTorch's answers exactly, on integer weights and activations (every sum
    exact in float32): a file in the cache that computes otherwise, damaged or planted, is rebuilt, not used.
    """
    def declare_and_check(library: ctypes.CDLL) -> None:
        pointer, size = ctypes.c_void_p, ctypes.c_int64
        # x, stored words, scales, out; rows, out_features, in_features, [group_size,] threads
        library.int8_word_product.argtypes = [pointer] * 4 + [size] * 3 + [ctypes.c_int]
        library.int4_word_product.argtypes = [pointer] * 4 + [size] * 4 + [ctypes.c_int]
        # stored words, scales, out; out_features, in_features, [group_size,] threads
        library.int8_dequantize.argtypes = [pointer] * 3 + [size] * 2 + [ctypes.c_int]
        library.int4_dequantize.argtypes = [pointer] * 3 + [size] * 3 + [ctypes.c_int]
        generator = torch.Generator().manual_seed(0)
        x = torch.randint(-4, 5, (2, 128), generator=generator).float()  # (rows, in)
        for scheme, group_size in [("int8", 0), ("int4", 8), ("int4", 32), ("int4", 128)]:
            largest = SCHEMES[scheme]  # each row (group) holds its largest value: scales are powers of two, exact
            q = torch.randint(-largest, largest + 1, (16, 128), generator=generator)
            q[:, :: group_size or 128] = largest
            weight = q.float() * 2.0 ** torch.arange(-4, 4).repeat(2)[:, None]  # (out, in)
            q, scales = quantize_int8(weight) if scheme == "int8" else _int4_values(weight, group_size)
            stored = to_word_order(q, VALUES_PER_WORD[scheme])
            stored = stored if scheme == "int8" else pack_int4(stored)
            product, dequantized = torch.empty(2, 16), torch.empty(16, 128)
            product_at, dequantized_at = product.data_ptr(), dequantized.data_ptr()
            if scheme == "int8":
                library.int8_word_product(x.data_ptr(), stored.data_ptr(), scales.data_ptr(), product_at, 2, 16, 128, 1)
                library.int8_dequantize(stored.data_ptr(), scales.data_ptr(), dequantized_at, 16, 128, 1)
            else:
                library.int4_word_product(x.data_ptr(), stored.data_ptr(), scales.data_ptr(), product_at, 2, 16, 128,
                                          group_size, 1)
                library.int4_dequantize(stored.data_ptr(), scales.data_ptr(), dequantized_at, 16, 128, group_size, 1)
            if not (torch.equal(product, x @ weight.T) and torch.equal(dequantized, weight)):
                raise ValueError(f"its {scheme} product or dequantized weight differs from PyTorch's")

    return native.load("word_product", declare_and_check)


def _library() -> ctypes.CDLL:
    library = _kernels()
    if library is None:
        raise RuntimeError("the C kernel of llmscratch/kernels/word_product.c is not built here (no working C "
                           "compiler, a build that failed or gave wrong answers: see the warning; or "
                           "LLMSCRATCH_NO_NATIVE=1): QuantizedLinear multiplies by .weight instead")
    return library


def _check_operands(stored: torch.Tensor, scales: torch.Tensor, scheme: str, group_size: int,
                    x: torch.Tensor | None = None) -> tuple[int, int]:
    """(out_features, in_features) of a word-ordered layer; ValueError where C would read out of bounds."""
    per_byte = 2 if scheme == "int4" else 1
    out_features, in_features = stored.size(0), stored.size(1) * per_byte
    expected_scales = (out_features,) if scheme == "int8" else (out_features, in_features // max(group_size, 1))
    tensors = [stored, scales] if x is None else [stored, scales, x]
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError(f"the C kernel runs on CPU tensors; got {[str(t.device) for t in tensors]}")
    if x is not None and x.size(-1) != in_features:
        raise ValueError(f"x has {x.size(-1)} features; the layer takes {in_features}")
    int4_groups_fit = scheme != "int4" or (group_size > 0 and in_features % group_size == 0)
    stored_dtype = torch.uint8 if scheme == "int4" else torch.int8
    if (scheme not in SCHEMES or not int4_groups_fit or stored.dtype != stored_dtype
            or not word_order_fits(scheme, in_features, group_size) or tuple(scales.shape) != expected_scales):
        raise ValueError(f"not a word-ordered {scheme} layer: stored {stored.dtype} {tuple(stored.shape)}, scales "
                         f"{tuple(scales.shape)}, group_size {group_size} (expected scales {expected_scales})")
    return out_features, in_features


# The kernels as PyTorch operators, so that torch.compile calls them as they are (it cannot see into C).
# Registered with the low-level API: a call costs a few microseconds less than through custom_op.
_OPERATORS = torch.library.Library("llmscratch", "DEF")
_OPERATORS.define("word_product(Tensor x, Tensor stored, Tensor scales, str scheme, int group_size) -> Tensor")
_OPERATORS.define("dequantize(Tensor stored, Tensor scales, str scheme, int group_size) -> Tensor")


def native_word_product(x: torch.Tensor, stored: torch.Tensor, scales: torch.Tensor, scheme: str,
                        group_size: int) -> torch.Tensor:
    """``word_product`` by the C kernel, on a CPU: x (..., in) times a word-ordered layer; (..., out).

    The operator ``llmscratch::word_product``. group_size: int4's (any value for int8). Threads:
    ``torch.get_num_threads()``, each taking a share of the output rows.
    """
    library = _library()
    out_features, in_features = _check_operands(stored, scales, scheme, group_size, x)
    rows = x.reshape(-1, in_features).float().contiguous()  # (rows, in)
    stored, scales = stored.contiguous(), scales.float().contiguous()  # held here while C reads them
    out = torch.empty(rows.size(0), out_features, dtype=torch.float32, device="cpu")  # (rows, out)
    pointers = [t.data_ptr() for t in (rows, stored, scales, out)]
    if scheme == "int8":
        library.int8_word_product(*pointers, rows.size(0), out_features, in_features, torch.get_num_threads())
    else:
        library.int4_word_product(*pointers, rows.size(0), out_features, in_features, group_size,
                                  torch.get_num_threads())
    return out.reshape(*x.shape[:-1], out_features).to(x.dtype)


_OPERATORS.impl("word_product", native_word_product, "CPU")


@torch.library.register_fake("llmscratch::word_product")
def _(x, stored, scales, scheme, group_size):
    return x.new_empty(*x.shape[:-1], stored.size(0))


def native_dequantize(stored: torch.Tensor, scales: torch.Tensor, scheme: str, group_size: int) -> torch.Tensor:
    """The float32 weight (out, in), natural column order, of a word-ordered layer, by the C kernel.

    The operator ``llmscratch::dequantize``.
    """
    library = _library()
    out_features, in_features = _check_operands(stored, scales, scheme, group_size)
    stored, scales = stored.contiguous(), scales.float().contiguous()  # held here while C reads them
    out = torch.empty(out_features, in_features, dtype=torch.float32, device="cpu")
    pointers = [t.data_ptr() for t in (stored, scales, out)]
    if scheme == "int8":
        library.int8_dequantize(*pointers, out_features, in_features, torch.get_num_threads())
    else:
        library.int4_dequantize(*pointers, out_features, in_features, group_size, torch.get_num_threads())
    return out


_OPERATORS.impl("dequantize", native_dequantize, "CPU")


@torch.library.register_fake("llmscratch::dequantize")
def _(stored, scales, scheme, group_size):
    return stored.new_empty(stored.size(0), stored.size(1) * (2 if scheme == "int4" else 1), dtype=torch.float32)


# --------------------------------------------------------------------------- which product a layer runs
def product_path(device_type: str, native: bool, word_order: bool, rows: int, grad: bool, compiling: bool) -> str:
    """How a ``QuantizedLinear`` multiplies ``rows`` rows of x on a device of ``device_type``.

    Off the CPU, always "dequantize_in_product" (``dequantized_product``): the C kernels are CPU code, so
    whether a C compiler exists never decides a GPU's path. On a CPU with the kernels built (``native``)
    and no gradient wanted: "kernel" (the word product, up to ``KERNEL_ROWS`` rows), or "chunks" (eager,
    more rows); without them, "word_product" for one row inside a compiled graph (inductor fuses it into
    one loop); otherwise "weight", ``F.linear`` by the dequantized ``.weight``.
    """
    if device_type != "cpu":
        return "dequantize_in_product"
    if native and not grad:
        if rows <= KERNEL_ROWS:
            return "kernel"
        if not compiling:
            return "chunks"
    if word_order and not native and rows == 1 and compiling:
        return "word_product"
    return "weight"


def dequantized_product(x: torch.Tensor, stored: torch.Tensor, scales: torch.Tensor, scheme: str,
                        group_size: int | None, word_order: bool) -> torch.Tensor:
    """x (..., in) times the weight ``stored`` and ``scales`` stand for, as gpt-fast and torchao write it for a GPU.

    int8: ``F.linear(x, q.to(x.dtype)) * scales``: a cast is all that stands between the stored integers and
    the product, so ``torch.compile`` fuses it into the product's reads, and the row scales multiply the
    outputs, not the weight. Word-ordered columns meet activations put in the same order (``to_word_order``
    of x: a permutation of one row, not of the weight). int4: the unpacked values times their group scales,
    in x's dtype, as the product's operand.
    """
    if scheme == "int8":
        if word_order:
            x = to_word_order(x.reshape(-1, x.size(-1)), VALUES_PER_WORD["int8"]).reshape(x.shape)
        return F.linear(x, stored.to(x.dtype)) * scales.to(x.dtype)  # (..., out)
    q = unpack_int4(stored)  # (out, in)
    q = from_word_order(q, VALUES_PER_WORD["int4"]) if word_order else q
    out_features, in_features = q.shape
    groups = q.to(x.dtype).reshape(out_features, -1, group_size) * scales.to(x.dtype)[..., None]  # (out, n_groups, g)
    return F.linear(x, groups.reshape(out_features, in_features))  # (..., out)


# --------------------------------------------------------------------------- the layer and the model
class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose weight is stored as int8 or packed int4 with float scales (no gradients).

    ``qweight`` holds the values in word order where the shape allows (``word_order_fits``), else
    in their natural order; ``weight`` is the dequantized float32 matrix either way. On a CPU with the
    C kernel built (``native``), a product of up to ``KERNEL_ROWS`` rows multiplies by the stored
    integers and one of more rows dequantizes ``CHUNK_ROWS`` weight rows at a time; on a GPU the values
    are dequantized inside the product (``dequantized_product``); ``product_path`` says which when.
    """

    def __init__(self, linear: nn.Linear, scheme: str, group_size: int = 64):
        super().__init__()
        if scheme not in SCHEMES:
            raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {sorted(SCHEMES)}")
        self.in_features, self.out_features, self.scheme = linear.in_features, linear.out_features, scheme
        self.group_size = group_size if scheme == "int4" else None
        self.word_order = word_order_fits(scheme, self.in_features, self.group_size)
        self.native = self.word_order and _kernels() is not None  # the C kernel serves products of few rows
        q, scales = quantize_int8(linear.weight) if scheme == "int8" else _int4_values(linear.weight, group_size)
        if self.word_order:
            q = to_word_order(q, VALUES_PER_WORD[scheme])
        self.register_buffer("qweight", q if scheme == "int8" else pack_int4(q))
        self.register_buffer("scales", scales)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self.register_buffer("bias", bias)

    def values(self) -> torch.Tensor:
        """The integer values (out, in) in their natural column order, as int8."""
        q = self.qweight if self.scheme == "int8" else unpack_int4(self.qweight)
        return from_word_order(q, VALUES_PER_WORD[self.scheme]) if self.word_order else q

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized float32 weight (out, in): what the layer multiplies by."""
        if self.native and self.qweight.device.type == "cpu":
            return torch.ops.llmscratch.dequantize(self.qweight, self.scales, self.scheme, self.group_size or 0)
        q = self.values().float()
        if self.scheme == "int8":
            return q * self.scales[:, None]
        groups = q.reshape(self.out_features, -1, self.group_size) * self.scales[..., None]
        return groups.reshape(self.out_features, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        path = product_path(x.device.type, self.native, self.word_order, x.numel() // x.size(-1),
                            x.requires_grad and torch.is_grad_enabled(), torch.compiler.is_compiling())
        if path == "dequantize_in_product":
            out = dequantized_product(x, self.qweight, self.scales, self.scheme, self.group_size, self.word_order)
        elif path == "kernel":
            out = torch.ops.llmscratch.word_product(x, self.qweight, self.scales, self.scheme, self.group_size or 0)
        elif path == "chunks":
            return self._product_by_chunks(x, bias)
        elif path == "word_product":  # no C compiler: inductor fuses this one
            out = word_product(x, self.qweight, self.scales, self.scheme)
        else:
            return F.linear(x, self.weight.to(x.dtype), bias)  # gradients for x, or many rows traced
        return out if bias is None else out + bias

    def _product_by_chunks(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """F.linear(x, self.weight, bias), dequantizing ``CHUNK_ROWS`` weight rows at a time."""
        out = x.new_empty(*x.shape[:-1], self.out_features)  # (..., out)
        for start in range(0, self.out_features, CHUNK_ROWS):
            rows = slice(start, start + CHUNK_ROWS)
            weight = torch.ops.llmscratch.dequantize(self.qweight[rows], self.scales[rows], self.scheme,
                                                     self.group_size or 0)
            out[..., rows] = F.linear(x, weight.to(x.dtype), None if bias is None else bias[rows])
        return out

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}{group}"


class QuantizedExperts(nn.Module):
    """A mixture of experts' stacked weights (E, out, in), each expert's rows stored as ``QuantizedLinear`` stores
    a matrix's: int8 with a scale per output row, or packed int4 with a scale per group of inputs (no gradients).

    ``experts[e]`` (or a list of ids) is the dequantized weight, (out, in) (or (n, out, in)), that ``MoE``
    multiplies by: a token dequantizes only the experts it chose.
    """

    def __init__(self, weight: torch.Tensor, scheme: str, group_size: int = 64):
        super().__init__()
        n_experts, out_features, in_features = weight.shape
        self.shape, self.scheme = weight.shape, scheme
        self.group_size = group_size if scheme == "int4" else None
        rows = weight.detach().reshape(n_experts * out_features, in_features)  # every expert's rows as one matrix
        q, scales = quantize_int8(rows) if scheme == "int8" else quantize_int4(rows, group_size)
        self.register_buffer("qweight", q.reshape(n_experts, out_features, -1))  # (E, out, in or in / 2)
        self.register_buffer("scales", scales.reshape(n_experts, out_features, *scales.shape[1:]))  # (E, out[, G])

    def __getitem__(self, experts: int | list[int]) -> torch.Tensor:
        q, scales = self.qweight[experts], self.scales[experts]  # (..., out, in or in / 2), (..., out[, G])
        if self.scheme == "int8":
            return q.to(scales.dtype) * scales[..., None]
        values = unpack_int4(q.reshape(-1, q.size(-1))).to(scales.dtype)  # (rows, in)
        groups = values.reshape(*scales.shape, self.group_size) * scales[..., None]  # (..., out, G, g)
        return groups.reshape(*q.shape[:-1], self.shape[-1])

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return f"n_experts={self.shape[0]}, out_features={self.shape[1]}, in_features={self.shape[2]}, " \
               f"{self.scheme}{group}"


EXPERT_WEIGHTS = ("gate", "up", "down")  # an MoE's stacked weights, (E, out, in) each


def quantize(model: nn.Module, scheme: str, group_size: int = 64, head: bool = True) -> nn.Module:
    """A copy of ``model`` whose blocks' linear layers are ``QuantizedLinear`` and whose mixtures of experts keep
    their experts in ``QuantizedExperts``; the original is untouched.

    head: also store the output head as int8 (under either scheme). A head tied to the embedding
    is untied: the embedding keeps its float32 rows for looking tokens up. Norms, embeddings and
    routers stay as they are. For int4, group_size must divide every quantized layer's input features.
    The copy records its settings in ``.quantization`` (what ``checkpoint.export_model`` saves); a
    model already quantized is refused (``quantizable_layers``). ``quantized_share`` says how much it holds as integers.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; expected one of {sorted(SCHEMES)}")
    linears, experts = quantizable_layers(model), quantizable_experts(model)
    if scheme == "int4":
        inputs = [(name, module.in_features) for name, module in linears]
        inputs += [(f"{name}.{part}", getattr(moe, part).shape[-1]) for name, moe in experts for part in EXPERT_WEIGHTS]
        for name, in_features in inputs:  # every layer checked before anything is built
            try:
                _check_int4_shape(in_features, group_size)
            except ValueError as err:
                raise ValueError(f"blocks.{name}: {err}") from None
    quantized = copy.deepcopy(model)
    for name, _ in linears:
        parent_name, _, child = name.rpartition(".")
        parent = quantized.blocks.get_submodule(parent_name)
        setattr(parent, child, QuantizedLinear(getattr(parent, child), scheme, group_size))
    for name, _ in experts:
        moe = quantized.blocks.get_submodule(name)
        for part in EXPERT_WEIGHTS:  # the parameter gives way to a module of the same name
            experts = QuantizedExperts(getattr(moe, part), scheme, group_size)
            delattr(moe, part)
            setattr(moe, part, experts)
    head = head and type(getattr(quantized, "lm_head", None)) is nn.Linear
    if head:
        quantized.lm_head = QuantizedLinear(quantized.lm_head, HEAD_SCHEME)
    quantized.quantization = {"scheme": scheme, "group_size": group_size if scheme == "int4" else None, "head": head}
    return quantized.eval()


def quantizable_layers(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The linear layers of ``model.blocks`` (names under it) that ``quantize`` replaces.

    ValueError for a model already quantized: its layers are no longer ``nn.Linear``, so a copy would say
    int4 and hold int8.
    """
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise ValueError(f"expected a model with .blocks (a GPT), got {type(model).__name__}")
    settings = getattr(model, "quantization", None)
    if settings is not None or any(isinstance(m, (QuantizedLinear, QuantizedExperts)) for m in model.modules()):
        raise ValueError(f"the model is already quantized ({describe(settings) if settings else 'in part'}); "
                         f"rounding rounded weights again loses more than quantizing once: quantize the float "
                         f"model it was made from")
    return [(name, module) for name, module in blocks.named_modules() if type(module) is nn.Linear]


def quantizable_experts(model: nn.Module) -> list[tuple[str, MoE]]:
    """The mixtures of experts of ``model.blocks`` (names under it) whose experts ``quantize`` stores as integers."""
    return [(name, module) for name, module in model.blocks.named_modules() if isinstance(module, MoE)]


def group_sizes(model: nn.Module) -> list[int]:
    """The int4 group sizes that fit every layer ``quantize`` replaces: even divisors of each one's inputs."""
    inputs = [linear.in_features for _, linear in quantizable_layers(model)]
    inputs += [getattr(moe, part).shape[-1] for _, moe in quantizable_experts(model) for part in EXPERT_WEIGHTS]
    common = math.gcd(*inputs)
    return [size for size in range(2, common + 1, 2) if common % size == 0]


def quantized_share(model: nn.Module) -> float:
    """The share of a model's matrix weights (every weight of two or more dimensions but the embeddings, whose
    rows are looked up, not multiplied) that it stores as integers."""
    embeddings = {id(module.weight) for module in model.modules() if isinstance(module, nn.Embedding)}
    floats = sum(p.numel() for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings)
    integers = sum(math.prod(m.shape) if isinstance(m, QuantizedExperts) else m.in_features * m.out_features
                   for m in model.modules() if isinstance(m, (QuantizedLinear, QuantizedExperts)))
    return integers / max(floats + integers, 1)


def describe(settings: dict, model: nn.Module | None = None) -> str:
    """A quantized model's ``.quantization`` in words: "int4 weights (group 64, int8 head)"; given the model,
    also the share of its matrix weights held as integers: "int8 weights (99.5% of the matrix weights)"."""
    details = [f"group {settings['group_size']}"] if settings.get("group_size") else []
    if settings["scheme"] != HEAD_SCHEME or not settings["head"]:
        details.append(f"{HEAD_SCHEME} head" if settings["head"] else "float head")
    if model is not None:
        details.append(f"{quantized_share(model):.1%} of the matrix weights")
    return f"{settings['scheme']} weights" + (f" ({', '.join(details)})" if details else "")
