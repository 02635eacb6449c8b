"""On a CUDA GPU: the model, each attention kernel, fused AdamW, decoding, LoRA and training, against the CPU.

Every test is marked cuda: where torch sees no GPU, tests/conftest.py deselects them, so a CPU run reports them
as deselected, never as passed. A result is held to float64 on the CPU, within a few times the rounding error
that a reference run in the same precision makes there (``assert_within_rounding``). Quantized decoding on CUDA
is tested in tests/test_quantize.py, beside the CPU's.
"""

import copy
import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch
from model_fixtures import LATER_SHAPES, randomize
from tiny_training import losses, make_trainer
from tolerances import assert_adamw_runs_agree
from torch.nn.attention import SDPBackend, sdpa_kernel

from llmscratch.device import autocast
from llmscratch.finetuning.config import LoRAConfig
from llmscratch.finetuning.lora import adapters_disabled, apply_lora, lora_layers, merge_lora
from llmscratch.model.attention import MultiHeadAttention
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import compiled_decode_one_token, decode_one_token, generate, prefill
from llmscratch.model.gpt import GPT
from llmscratch.model.rope import RotaryEmbedding
from llmscratch.profiling import sdpa_kernels
from llmscratch.training.config import TrainConfig
from llmscratch.training.distributed import DistInfo
from llmscratch.training.optim import configure_optimizer

# Sized for well under 90 s on an H100, its two torch.compile tests included: a hang fails long before 15 minutes.
pytestmark = [pytest.mark.cuda, pytest.mark.timeout(180)]

CUDA = torch.device("cuda")
# A GPT-2 (learned positions, biases, tied head, 4 heads) and a Llama (RoPE, SwiGLU, 4 query heads sharing 2
# key/value heads), both with heads of 16: a multiple of 8, as the fused attention kernels want. Their vocabularies
# (97, 89) are no multiple of 64, so the loss on CUDA pads its products (losses.PAD_VOCAB_TO) in every model test.
DESIGNS = {
    "gpt2": GPTConfig.from_preset("gpt2-small", vocab_size=97, context_length=32, d_model=64, n_layers=2, n_heads=4),
    "llama-gqa": GPTConfig.from_preset("llama-tiny", vocab_size=89, context_length=32, d_model=64, n_layers=2,
                                       d_ff=128, tie_embeddings=False),
    # Issue 34's kinds (tests/model_fixtures.py): "gemma", Gemma 3's (sliding windows of 5 positions in layers 0
    # and 2, so an explicit mask reaches the attention kernel; QK-norm, norms after each sublayer, scaled
    # embeddings, GeGLU, two RoPE tables, heads of 12); "moe", a mixture of 5 experts, top 2, with a shared
    # expert and a dense layer (the tokens sorted by expert, each expert's rows gathered and added back).
    **{kind: GPTConfig(context_length=32, **shape) for kind, shape in LATER_SHAPES.items()},
}
# Under bfloat16 a token whose two best experts score within bfloat16's rounding of each other can be routed
# to another expert than in float64: a whole expert's difference, not rounding, so the bfloat16 bound below
# does not hold for a mixture of experts. It is trained in bfloat16 on CUDA by the LoRA test.
ROUNDING_DESIGNS = [design for design in DESIGNS if not DESIGNS[design].n_experts]

# How many times the reference's own rounding error a result may be off by (see assert_within_rounding).
# Outputs: the same precision through other kernels that sum in other orders. Two such paths on a CPU (math and
# flash attention under this file's tests) come within 0.5x to 1.7x of each other's error; PyTorch's tests of
# its fused attention kernels (test/test_transformers.py) allow 4x on the output. 8x leaves room for cuBLAS.
OUTPUT_FACTOR = 8
# float32 gradients go back through fused attention: the memory-efficient kernel computes float32 products as
# three TF32 ones (2^-22, 4x float32's rounding), and every fused backward recomputes the softmax blockwise.
# PyTorch's same tests allow up to 160x on grad_query for these kernels. Matrix products on TF32 operands
# (2^-11) came out 1,500x to 3,500x (emulated on a CPU), a swapped weight or a wrong head grouping 10^4x and more.
FLOAT32_GRADIENT_FACTOR = 160
# In bfloat16 the reference (autocast on the CPU, or the explicit attention path) rounds every intermediate to 8
# bits itself, as coarsely as any kernel does: the same 8x as the outputs. So a bfloat16 case catches only what
# is off by more than bfloat16's own ~1% (a swapped weight, a mask, a head grouping); the float32 cases, the rest.
BFLOAT16_GRADIENT_FACTOR = 8


def assert_within_rounding(actual: dict, reference: dict, exact: dict, factor: float, dtype: torch.dtype,
                           what: str = "") -> dict[str, float]:
    """Each tensor of ``actual`` is at most ``factor`` times as far from ``exact`` as ``reference`` is.

    exact: the computation in float64 (on the CPU). reference: the same computation in ``dtype`` by other
    kernels, so its distance from exact is what rounding in dtype costs on these values. A reference that
    happens to land on exact still allows one rounding of the largest value (dtype's eps times it).
    Every tensor is float64 on the CPU; returns the distance allowed to each.
    """
    assert actual.keys() == reference.keys() == exact.keys()
    allowed = {}
    for name, truth in exact.items():
        one_rounding = torch.finfo(dtype).eps * truth.abs().max().item()
        reference_error = max((reference[name] - truth).abs().max().item(), one_rounding)
        error = (actual[name] - truth).abs().max().item()
        allowed[name] = factor * reference_error
        assert error <= allowed[name], (
            f"{what}{name}: {error:.3g} from float64, {error / reference_error:.1f}x the reference's rounding "
            f"error in {dtype} ({reference_error:.3g}); at most {factor}x allowed")
    return allowed


def tiny(design: str, **overrides) -> GPT:
    """The design's model (fields overridden) on the CPU, every weight random at scale 0.2 (tests/model_fixtures.py)."""
    model = GPT(dataclasses.replace(DESIGNS[design], **overrides))
    randomize(model, seed=0, scale=0.2)
    return model


def token_batch(config: GPTConfig, batch_size: int = 2, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Random inputs and next-token targets (B, T) each, on the CPU."""
    generator = torch.Generator().manual_seed(seed)
    idx, targets = (torch.randint(config.vocab_size, (batch_size, config.context_length), generator=generator)
                    for _ in range(2))
    return idx, targets


def step_results(model: GPT, idx: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype = torch.float32,
                 compiled=None) -> tuple[dict, dict]:
    """One training step's forward and backward where the model is: ({"loss", "logits"}, every gradient), each
    as float64 on the CPU.

    dtype: the autocast precision (float32: none). The loss is the model's own training path (the chunked
    cross-entropy of llmscratch.model.losses); the logits come from a forward without targets. compiled: the model
    through torch.compile, called instead; its logits are left out (a second graph to compile).
    """
    device = next(model.parameters()).device
    idx, targets = idx.to(device), targets.to(device)
    model.zero_grad(set_to_none=True)
    with autocast(device, dtype):
        loss = (model if compiled is None else compiled)(idx, targets=targets)  # ()
    loss.backward()
    outputs = {"loss": loss.detach()}
    if compiled is None:
        with torch.no_grad(), autocast(device, dtype):
            outputs["logits"] = model(idx)  # (B, T, V)
    gradients = {name: param.grad for name, param in model.named_parameters()}
    return ({name: t.double().cpu() for name, t in outputs.items()},
            {name: t.double().cpu() for name, t in gradients.items()})


def logits_of(model: GPT, idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"logits"}: the model's float32 logits (B, T, V) for idx, as float64 on the CPU."""
    with torch.no_grad():
        return {"logits": model(idx.to(next(model.parameters()).device)).double().cpu()}


# --------------------------------------------------------------------------- the model
@pytest.mark.parametrize("design", DESIGNS)
def test_float32_on_cuda_matches_float32_on_the_cpu(design):
    """The same weights and batch: CUDA's float32 is within float32 rounding of float64, as the CPU's is
    (so the two are within 1 + factor times the CPU's rounding error of each other)."""
    model = tiny(design)
    idx, targets = token_batch(model.config)
    exact = step_results(copy.deepcopy(model).double(), idx, targets)
    on_cpu = step_results(model, idx, targets)
    on_gpu = step_results(copy.deepcopy(model).to(CUDA), idx, targets)
    assert_within_rounding(on_gpu[0], on_cpu[0], exact[0], OUTPUT_FACTOR, torch.float32)
    assert_within_rounding(on_gpu[1], on_cpu[1], exact[1], FLOAT32_GRADIENT_FACTOR, torch.float32, "gradient of ")


@pytest.mark.parametrize("design", ROUNDING_DESIGNS)
def test_bfloat16_autocast_on_cuda_stays_within_bfloat16_rounding(design):
    """Under bfloat16 autocast the GPU is as close to float64 as bfloat16 autocast on the CPU is."""
    model = tiny(design)
    idx, targets = token_batch(model.config)
    exact = step_results(copy.deepcopy(model).double(), idx, targets)
    on_cpu = step_results(model, idx, targets, torch.bfloat16)
    gpu_model = copy.deepcopy(model).to(CUDA)
    on_gpu = step_results(gpu_model, idx, targets, torch.bfloat16)
    assert_within_rounding(on_gpu[0], on_cpu[0], exact[0], OUTPUT_FACTOR, torch.bfloat16)
    assert_within_rounding(on_gpu[1], on_cpu[1], exact[1], BFLOAT16_GRADIENT_FACTOR, torch.bfloat16, "gradient of ")
    # It did run in bfloat16 (a float32 run would pass the bounds above too); the weights and their
    # gradients stayed float32.
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in gpu_model.parameters())
    with torch.no_grad(), autocast(CUDA, torch.bfloat16):
        assert gpu_model(idx.to(CUDA)).dtype == torch.bfloat16
    assert on_gpu[0]["loss"].item() != step_results(gpu_model, idx, targets)[0]["loss"].item()


# One layer each: compiling takes most of this file's time. The mixture of experts breaks the graph where it
# reads each expert's count on the host.
COMPILED = {"llama-gqa": dict(n_layers=1), "moe": dict(n_layers=1, dense_layers=())}


@pytest.mark.parametrize("design", COMPILED)
def test_compiled_model_on_cuda_matches_eager(design):
    """torch.compile's loss and gradients (Llama with grouped-query attention; a mixture of experts) against
    eager, both on CUDA."""
    import torch._dynamo  # here: importing it takes seconds, which a CPU run that deselects this file never pays

    torch._dynamo.reset()
    model = tiny(design, **COMPILED[design]).to(CUDA)
    idx, targets = token_batch(model.config)
    exact = step_results(copy.deepcopy(model).cpu().double(), idx, targets)  # the weights the GPU holds
    eager = step_results(model, idx, targets)
    compiled = step_results(model, idx, targets, compiled=torch.compile(model))
    del eager[0]["logits"], exact[0]["logits"]  # the compiled run has only the loss
    assert_within_rounding(compiled[0], eager[0], exact[0], OUTPUT_FACTOR, torch.float32)
    assert_within_rounding(compiled[1], eager[1], exact[1], FLOAT32_GRADIENT_FACTOR, torch.float32, "gradient of ")


# --------------------------------------------------------------------------- attention kernels
# The cases each backend documents for torch 2.11 (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp): flash
# and cuDNN take float16 and bfloat16 only; memory-efficient takes float32 too, but only with as many key/value
# heads as query heads (grouped-query support came to it after 2.11); math takes anything. "gpt2": multi-head,
# q, k, v views of one projection; "llama-gqa": RoPE'd queries and keys, 2 key/value heads for 4 query heads.
BACKEND_CASES = [
    (SDPBackend.MATH, torch.float32, "gpt2"), (SDPBackend.MATH, torch.float32, "llama-gqa"),
    (SDPBackend.MATH, torch.bfloat16, "gpt2"), (SDPBackend.MATH, torch.bfloat16, "llama-gqa"),
    (SDPBackend.FLASH_ATTENTION, torch.bfloat16, "gpt2"), (SDPBackend.FLASH_ATTENTION, torch.bfloat16, "llama-gqa"),
    (SDPBackend.EFFICIENT_ATTENTION, torch.float32, "gpt2"), (SDPBackend.EFFICIENT_ATTENTION, torch.bfloat16, "gpt2"),
    (SDPBackend.CUDNN_ATTENTION, torch.bfloat16, "gpt2"), (SDPBackend.CUDNN_ATTENTION, torch.bfloat16, "llama-gqa"),
]
KERNEL_NAMES = {SDPBackend.MATH: "math", SDPBackend.FLASH_ATTENTION: "flash",
                SDPBackend.EFFICIENT_ATTENTION: "efficient", SDPBackend.CUDNN_ATTENTION: "cudnn"}
# One whole tile of the kernels (flash and cuDNN work in blocks of 64 or 128 positions): cuDNN before 9.15.1 has
# a known fault with lengths that are not a multiple of 128 (why torch prefers it only from then on).
ATTENTION_LENGTH = 128


def attention_layer(design: str) -> tuple[MultiHeadAttention, RotaryEmbedding | None]:
    """The design's attention (biases on, so that none hides at zero) and its RoPE table, on the CPU."""
    config = DESIGNS[design]
    torch.manual_seed(0)
    attention = MultiHeadAttention(config.d_model, config.d_model, config.n_heads, config.kv_heads, qkv_bias=True,
                                   out_bias=True)
    rope = RotaryEmbedding(config.head_dim, ATTENTION_LENGTH) if config.position == "rope" else None
    return attention, rope


def attention_results(attention: MultiHeadAttention, rope: RotaryEmbedding | None, x: torch.Tensor,
                      upstream: torch.Tensor, explicit: bool) -> tuple[dict, dict]:
    """({"output"}, the gradients of x and the weights) of attention on x, upstream sent back; float64 on the CPU.

    explicit: the written-out path (need_weights forces it), else scaled_dot_product_attention.
    """
    x = x.detach().requires_grad_()
    output = attention(x, rope, need_weights=True)[0] if explicit else attention(x, rope)  # (B, T, d)
    inputs = {"x": x, "qkv.weight": attention.qkv.weight, "out_proj.weight": attention.out_proj.weight}
    gradients = torch.autograd.grad(output, list(inputs.values()), upstream)
    return ({"output": output.detach().double().cpu()},
            {name: grad.double().cpu() for name, grad in zip(inputs, gradients)})


@pytest.mark.parametrize("backend, dtype, design", BACKEND_CASES,
                         ids=[f"{b.name.lower()}-{str(t).removeprefix('torch.')}-{d}" for b, t, d in BACKEND_CASES])
def test_each_attention_backend_matches_the_explicit_path(backend, dtype, design):
    """Forward and backward through one SDPA backend against the explicit softmax path, in the same precision."""
    needs_sm80 = backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION) or (
        backend == SDPBackend.EFFICIENT_ATTENTION and dtype == torch.bfloat16)
    capability = torch.cuda.get_device_capability(CUDA)
    if needs_sm80 and capability < (8, 0):
        pytest.skip(f"{backend.name} in {dtype} needs compute capability 8.0; this GPU has {capability}")
    attention, rope = attention_layer(design)
    attention.to(dtype)  # the low-precision weights are the exact values all three runs start from
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(2, ATTENTION_LENGTH, attention.d_out, generator=generator).to(dtype)  # (B, T, d)
    upstream = torch.randn(x.shape, generator=generator).to(dtype)  # a random gradient: no direction left out
    exact_rope = None if rope is None else copy.deepcopy(rope).double()
    exact = attention_results(copy.deepcopy(attention).double(), exact_rope, x.double(), upstream.double(),
                              explicit=True)
    attention.to(CUDA)
    rope = None if rope is None else rope.to(CUDA)
    explicit = attention_results(attention, rope, x.to(CUDA), upstream.to(CUDA), explicit=True)
    with sdpa_kernel([backend]), warnings.catch_warnings(record=True) as reasons:
        warnings.simplefilter("always")
        try:
            fused = attention_results(attention, rope, x.to(CUDA), upstream.to(CUDA), explicit=False)
            kernels = sdpa_kernels(lambda: attention(x.to(CUDA), rope))
        except RuntimeError as error:  # "No available kernel": the warnings say why
            why = "; ".join(str(reason.message) for reason in reasons)
            pytest.fail(f"{backend.name} should run {dtype} attention with {design}'s heads (torch 2.11 documents "
                        f"it), but refused on {torch.cuda.get_device_name(CUDA)} (compute capability {capability}, "
                        f"torch {torch.__version__}): {error} {why}")
    assert any(KERNEL_NAMES[backend] in name for name in kernels), f"{backend.name} asked for, {kernels} ran"
    gradient_factor = FLOAT32_GRADIENT_FACTOR if dtype == torch.float32 else BFLOAT16_GRADIENT_FACTOR
    assert_within_rounding(fused[0], explicit[0], exact[0], OUTPUT_FACTOR, dtype)
    assert_within_rounding(fused[1], explicit[1], exact[1], gradient_factor, dtype, "gradient of ")


# --------------------------------------------------------------------------- fused AdamW
def test_fused_adamw_on_cuda_takes_the_steps_of_foreach_adamw_on_the_cpu(tmp_path):
    """Four training steps (tests/tiny_training.py) on each device: configure_optimizer picks fused on CUDA."""
    on_cpu = make_trainer(tmp_path / "cpu", max_steps=4)
    on_gpu = make_trainer(tmp_path / "cuda", dist_info=DistInfo(device=CUDA), max_steps=4)
    assert on_gpu.optimizer_step.optimizer.defaults["fused"] and not on_cpu.optimizer_step.optimizer.defaults["fused"]
    assert on_cpu.optimizer_step.optimizer.defaults["foreach"]
    cpu_losses = [on_cpu.train_step()[0] for _ in range(4)]
    gpu_losses = [on_gpu.train_step()[0] for _ in range(4)]
    # The same arithmetic on other kernels: a loss of about 5.7 moves by a few float32 ulps per operation of the
    # network; 1e-4 is ~20 ulps of it (as test_train's compiled-against-eager run). The weights: float32
    # rounding, amplified by AdamW where gradients are near zero (tests/tolerances.py).
    assert gpu_losses == pytest.approx(cpu_losses, abs=1e-4)
    gpu_weights = {name: tensor.cpu() for name, tensor in on_gpu.model.state_dict().items()}
    assert_adamw_runs_agree(gpu_weights, on_cpu.model.state_dict(), lr=on_cpu.config.lr, steps=4)


# --------------------------------------------------------------------------- decoding
def prompts(config: GPTConfig, batch_size: int = 3, length: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randint(config.vocab_size, (batch_size, length), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def cached_logits(model: GPT, tokens: torch.Tensor, prompt_length: int, step=decode_one_token) -> torch.Tensor:
    """Next-token logits (B, T - prompt_length, V) of tokens (B, T) decoded through KV caches, float64 on the CPU.

    The prompt is prefilled in one forward, then each later token is fed alone at its position by ``step``
    (``decode_one_token`` or its compiled version), as ``generate`` does.
    """
    caches = model.make_kv_caches(tokens.size(0), tokens.size(1) - 1)  # generate's size: the last token is never fed
    rows = [prefill(model, tokens[:, :prompt_length], caches)]  # (B, V) each
    for position in range(prompt_length, tokens.size(1) - 1):
        token = tokens[:, position : position + 1].contiguous()  # (B, 1) laid out as generate's, for one graph
        rows.append(step(model, token, torch.tensor([position], device=tokens.device), caches))
    return torch.stack(rows, dim=1).double().cpu()  # (B, T - prompt_length, V)


def assert_decoded_logits_match(model: GPT, tokens: torch.Tensor, decoded: torch.Tensor, prompt_length: int) -> None:
    """The decoded logits are within float32 rounding of the model's full forward, and every greedy choice in
    ``tokens`` has a margin that rounding within that bound cannot overturn.

    Float64 is the model's own weights on the CPU: what the move to the GPU does is test_float32_on_cuda's to check.
    """
    with torch.no_grad():
        exact = copy.deepcopy(model).cpu().double()(tokens[:, :-1].cpu())[:, prompt_length - 1 :]  # (B, n, V)
        reference = model(tokens[:, :-1])[:, prompt_length - 1 :].double().cpu()  # (B, n, V), no cache
    allowed = assert_within_rounding({"logits": decoded}, {"logits": reference}, {"logits": exact}, OUTPUT_FACTOR,
                                     torch.float32)["logits"]
    top2 = exact.topk(2, dim=-1).values  # (B, n, 2)
    assert (top2[..., 0] - top2[..., 1]).min() > 2 * allowed, "a near-tie: pick another seed for this test"


@pytest.mark.parametrize("design", DESIGNS)
def test_kv_cache_decoding_on_cuda_matches_decoding_without_it(design):
    model = tiny(design).eval().to(CUDA)
    idx = prompts(model.config)
    expected = generate(model, idx, 26, use_cache=False)  # 6 + 26 = 32 tokens: the whole context, re-run each step
    assert torch.equal(generate(model, idx, 26), expected)
    assert all(len(set(row.tolist())) > 3 for row in expected[:, 6:])  # not one repeated token
    assert_decoded_logits_match(model, expected, cached_logits(model, expected, 6), 6)


def test_compiled_decoding_on_cuda_compiles_once_and_matches_decoding_without_a_cache():
    import torch._dynamo  # here: importing it takes seconds, which a CPU run that deselects this file never pays
    from torch._dynamo.utils import counters

    # One layer (compiling takes most of this file's time): RoPE read at a position tensor, grouped-query
    # attention over the cache.
    model = tiny("llama-gqa", n_layers=1).eval().to(CUDA)
    idx = prompts(model.config, seed=3)
    expected = generate(model, idx, 26, use_cache=False)
    torch._dynamo.reset()
    counters.clear()
    assert torch.equal(generate(model, idx, 26, compile=True), expected)
    decoded = cached_logits(model, expected, 6, step=compiled_decode_one_token(device="cuda"))
    assert counters["stats"]["unique_graphs"] == 1  # 25 + 25 steps, one compilation
    assert_decoded_logits_match(model, expected, decoded, 6)


# --------------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("design", DESIGNS)
def test_lora_on_cuda_trains_only_the_adapters_and_merges_to_the_same_model(design):
    model = tiny(design).to(CUDA)
    apply_lora(model, LoRAConfig(rank=4, alpha=8))
    frozen = {name: p.detach().clone() for name, p in model.named_parameters() if not p.requires_grad}
    adapters = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert adapters and all(name.endswith(("lora_a", "lora_b")) for name in adapters)
    optimizer = configure_optimizer(model, TrainConfig(lr=1e-2), CUDA)  # fused AdamW, on the adapters alone
    model.train()
    for seed in range(3):
        idx, targets = token_batch(model.config, seed=seed)
        with autocast(CUDA, torch.bfloat16):
            loss = model(idx.to(CUDA), targets=targets.to(CUDA))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    after = dict(model.named_parameters())
    assert all(torch.equal(after[name], before) for name, before in frozen.items())  # bit for bit
    assert all(not torch.equal(after[name], before) for name, before in adapters.items())  # every A and every B

    idx, _ = token_batch(model.config, seed=5)
    exact = logits_of(copy.deepcopy(model).cpu().double(), idx)
    adapted = logits_of(model, idx)
    merged_model = merge_lora(copy.deepcopy(model))
    assert not lora_layers(merged_model)
    allowed = assert_within_rounding(logits_of(merged_model, idx), adapted, exact, OUTPUT_FACTOR, torch.float32)
    # The check has power: what the adapters add is far beyond that bound, so a merge that lost it would fail.
    with adapters_disabled(model):
        base = logits_of(model, idx)
    assert (adapted["logits"] - base["logits"]).abs().max() > 100 * allowed["logits"]


# --------------------------------------------------------------------------- end to end
def test_training_on_cuda_in_bfloat16_lowers_the_loss(tmp_path):
    """The Trainer's whole run (steps, evaluation, sample, checkpoint) on CUDA under bfloat16 autocast."""
    trainer = make_trainer(tmp_path, dist_info=DistInfo(device=CUDA), max_steps=40, lr=1e-2, min_lr=1e-3,
                           dtype="bfloat16")
    before = trainer.evaluate(512)["loss"]
    summary = trainer.fit(progress=False)
    history = losses(trainer)
    assert len(history) == 40 and all(math.isfinite(loss) for loss in history)
    assert math.log(320) - 0.2 < before < math.log(320) + 0.2  # an untrained model guesses uniformly
    # The margins of test_train's 40-step float32 run on the CPU: bfloat16 autocast follows float32's losses to
    # about 1% (test_train), a few hundredths of a nat; a run that does not learn stays near its start.
    assert np.mean(history[-5:]) < history[0] - 1.0
    assert summary["val_loss"] < before - 1.0
    assert all(p.device.type == CUDA.type and p.dtype == torch.float32 for p in trainer.model.parameters())
