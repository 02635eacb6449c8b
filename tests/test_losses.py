"""The chunked cross-entropy, of a weight or of any head module, against F.cross_entropy on the full logits."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmscratch.model import losses
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.model.losses import head_cross_entropy, linear_cross_entropy


def problem(n_rows=30, d=16, vocab=53, seed=0, ignored=()):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n_rows, d, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, d, generator=generator, dtype=torch.float64)
    targets = torch.randint(vocab, (n_rows,), generator=generator)
    targets[list(ignored)] = -100
    return hidden.requires_grad_(), weight.requires_grad_(), targets


def loss_and_grads(fn, hidden, weight, targets):
    hidden.grad = weight.grad = None
    loss = fn(hidden, weight, targets)
    loss.backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def reference(hidden, weight, targets):
    return F.cross_entropy(hidden @ weight.T, targets)


# Chunks that divide the rows, that don't, of one row, and larger than all rows.
@pytest.mark.parametrize("chunk_rows", [1, 7, 10, 30, 64])
@pytest.mark.parametrize("ignored", [(), (0, 5, 29), tuple(range(1, 30))])
def test_matches_cross_entropy_of_the_full_logits(chunk_rows, ignored):
    hidden, weight, targets = problem(ignored=ignored)
    expected = loss_and_grads(reference, hidden, weight, targets)
    got = loss_and_grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_rows=chunk_rows), hidden, weight, targets)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    if ignored:  # an ignored row gets no gradient at all
        assert hidden.grad[list(ignored)].abs().max() == 0


def test_float32_and_scaled_gradient_output():
    hidden, weight, targets = problem(seed=1)
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    (3.0 * linear_cross_entropy(h32, w32, targets, chunk_rows=8)).backward()
    (3.0 * reference(hidden, weight, targets)).backward()
    torch.testing.assert_close(h32.grad, hidden.grad.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w32.grad, weight.grad.float(), rtol=1e-5, atol=1e-6)


def test_all_targets_ignored_gives_nan_like_cross_entropy():
    hidden, weight, targets = problem(ignored=range(30))
    assert torch.isnan(reference(hidden, weight, targets))
    assert torch.isnan(linear_cross_entropy(hidden, weight, targets))
    assert torch.isnan(linear_cross_entropy(hidden[:0], weight, targets[:0]))  # no rows at all


def test_gradient_of_one_input_only_and_no_grad():
    hidden, weight, targets = problem(seed=2)
    frozen = weight.detach()
    linear_cross_entropy(hidden, frozen, targets, chunk_rows=4).backward()
    expected_hidden = hidden.grad.clone()
    hidden.grad = None
    reference(hidden, frozen, targets).backward()
    torch.testing.assert_close(expected_hidden, hidden.grad, rtol=1e-10, atol=1e-12)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden, weight, targets)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, reference(hidden, weight, targets).detach(), rtol=1e-12, atol=0)


def test_bfloat16_autocast_is_close_to_autocast_reference():
    hidden, weight, targets = problem(n_rows=64, d=32, vocab=97, seed=3)
    h32, w32 = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = loss_and_grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_rows=16), h32, w32, targets)
        expected = loss_and_grads(lambda h, w, t: F.cross_entropy((h @ w.T).float(), t), h32, w32, targets)
    exact = loss_and_grads(reference, hidden, weight, targets)
    assert got[1].dtype == torch.float32 and got[2].dtype == torch.float32  # gradients in the inputs' dtype
    for g, e, x in zip(got, expected, exact):
        # bf16 products: both are about as far from the float64 truth; ours no farther than autocast's.
        ours, theirs = (g.double() - x).abs().max(), (e.double() - x).abs().max()
        assert ours <= 2 * theirs + 1e-6, (ours, theirs)
        assert ours <= 0.05 * x.abs().max()


@pytest.mark.parametrize("multiple", [1, 8, 64, 100])  # 53 rows padded by 0, 3, 11, 47
@pytest.mark.parametrize("autocast", [False, True])
def test_a_vocabulary_padded_inside_the_products_gives_the_same_loss_and_gradients(monkeypatch, multiple, autocast):
    """What CUDA does (losses.PAD_VOCAB_TO), forced on the CPU: zero rows, -inf logits, the gradients of V rows."""
    monkeypatch.setitem(losses.PAD_VOCAB_TO, "cpu", multiple)
    hidden, weight, targets = problem(seed=4, ignored=(2, 3))
    if autocast:  # bf16 products, with the softmax in float32 on the padded (c, V_padded) logits
        hidden, weight = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = loss_and_grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_rows=7), hidden, weight, targets)
        monkeypatch.setitem(losses.PAD_VOCAB_TO, "cpu", 1)
        unpadded = loss_and_grads(lambda h, w, t: linear_cross_entropy(h, w, t, chunk_rows=7), hidden, weight, targets)
    expected = loss_and_grads(reference, hidden, weight, targets)
    for g, u, e in zip(got, unpadded, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        if autocast:  # the same bf16 products and float32 sums, padded or not
            torch.testing.assert_close(g, u, rtol=1e-6, atol=1e-7)
        else:
            torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("bad", [
    dict(hidden=torch.zeros(4, 3)),  # hidden's width is not the weight's
    dict(targets=torch.zeros(5, dtype=torch.long)),  # a target more than rows: never silently left out
    dict(targets=torch.zeros(3, dtype=torch.long)),  # a target fewer
])
def test_shapes_that_do_not_fit_are_an_error_not_a_wrong_loss(bad):
    """Nothing is checked per step; the shapes themselves make torch refuse a mismatch."""
    args = dict(hidden=torch.zeros(4, 8), weight=torch.zeros(10, 8), targets=torch.zeros(4, dtype=torch.long))
    args.update(bad)
    with pytest.raises(RuntimeError):
        linear_cross_entropy(args["hidden"], args["weight"], args["targets"])


TINY = {
    "gpt2": dict(vocab_size=97, context_length=24, d_model=32, n_layers=2, n_heads=4),
    "llama-untied": dict(vocab_size=89, context_length=24, d_model=48, n_layers=2, n_heads=6, n_kv_heads=2,
                         d_ff=80, norm="rmsnorm", mlp="swiglu", position="rope", qkv_bias=False, bias=False,
                         tie_embeddings=False),
}


@pytest.mark.parametrize("kind", sorted(TINY))
def test_model_loss_with_targets_matches_the_logits_path(kind):
    """GPT(idx, targets=t) is the explicit logits + cross-entropy, loss and every gradient."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**TINY[kind])).double()
    idx = torch.randint(model.config.vocab_size, (3, 24))
    targets = torch.roll(idx, -1, dims=1)
    targets[:, -1] = -100  # the last position has no next token
    explicit = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    explicit.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    fused = model(idx, targets=targets)
    fused.backward()
    torch.testing.assert_close(fused, explicit, rtol=1e-12, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name], rtol=1e-9, atol=1e-12, msg=name)
    with pytest.raises(RuntimeError, match="invalid for input of size"):  # targets of another shape: an error
        model(idx, targets=targets[:, :-1])


def two_layer_head(seed=0):
    """A head that is not a plain Linear: biased, two layers, a nonlinearity between."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 24), nn.Tanh(), nn.Linear(24, 53)).double()


@pytest.mark.parametrize("chunk_rows", [1, 7, 64])
def test_any_head_module_matches_cross_entropy_of_its_logits(chunk_rows):
    head = two_layer_head()
    hidden, _, targets = problem(ignored=(0, 5, 29))

    def loss_and_grads(fn):
        hidden.grad = None
        head.zero_grad()
        loss = fn()
        loss.backward()
        return [loss.detach(), hidden.grad.clone(), *(p.grad.clone() for p in head.parameters())]

    expected = loss_and_grads(lambda: F.cross_entropy(head(hidden), targets))
    got = loss_and_grads(lambda: head_cross_entropy(hidden, head, targets, chunk_rows=chunk_rows))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-12)
    assert hidden.grad[[0, 5, 29]].abs().max() == 0  # an ignored row sends nothing back
    head[0].requires_grad_(False)  # a frozen part of the head gets no gradient
    head.zero_grad()
    head_cross_entropy(hidden, head, targets, chunk_rows=chunk_rows).backward()
    assert head[0].weight.grad is None and head[2].weight.grad is not None
    with torch.no_grad():
        assert not head_cross_entropy(hidden, head, targets).requires_grad


def test_a_plain_linear_head_takes_the_linear_path():
    hidden, weight, targets = problem(seed=4)
    head = nn.Linear(16, 53, bias=False).double()
    with torch.no_grad():
        head.weight.copy_(weight)
    assert torch.equal(head_cross_entropy(hidden, head, targets, chunk_rows=7),
                       linear_cross_entropy(hidden, weight, targets, chunk_rows=7))


def test_a_head_module_under_bfloat16_autocast_is_close_to_autocast_reference():
    head = two_layer_head(seed=5).float()
    hidden, _, targets = problem(n_rows=64, seed=5)
    h32 = hidden.detach().float().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = head_cross_entropy(h32, head, targets, chunk_rows=16)
        expected = F.cross_entropy(head(h32).float(), targets)
    (got_grad,) = torch.autograd.grad(got, h32)
    (expected_grad,) = torch.autograd.grad(expected, h32)
    assert got_grad.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)  # the same bf16 products
    torch.testing.assert_close(got_grad, expected_grad, rtol=1e-5, atol=1e-8)
    assert got != F.cross_entropy(head(h32), targets)  # and they were bf16: the head ran under autocast


def test_left_out_of_compiled_graphs_and_dynamo_not_imported_until_then():
    """Both losses run eagerly inside torch.compile (a graph break, equal results), and importing the model does
    not import torch._dynamo (about 2 s of every script's start-up)."""
    import subprocess
    import sys

    code = "import sys, llmscratch.model.gpt, llmscratch.model.losses; print('torch._dynamo' in sys.modules)"
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert imported.stdout.strip() == "False", imported.stderr

    seen = []
    hidden, weight, targets = problem()
    head = nn.Linear(16, 53, bias=False, dtype=torch.float64)
    for fn, arg in ((losses.linear_cross_entropy, weight), (losses.head_cross_entropy, head)):
        def step(h, fn=fn, arg=arg):
            seen.append(torch.compiler.is_compiling())  # traced: True; run eagerly: False
            return fn(torch.sin(h), arg, targets) * 2

        torch._dynamo.reset()
        explained = torch._dynamo.explain(step)(hidden.detach())
        assert explained.graph_break_count >= 1, f"{fn.__name__} was traced into the graph"
        compiled = torch.compile(step, backend="eager")(hidden.detach())
        torch.testing.assert_close(compiled, step(hidden.detach()), rtol=0, atol=0)
    assert True in seen  # the steps themselves were traced


def test_chunks_are_larger_on_a_gpu_and_the_memory_plan_follows():
    """About 64 MiB of float32 logits per chunk on a CPU, 1 GiB on CUDA (small products waste a GPU)."""
    from llmscratch.model.losses import CHUNK_BYTES, default_chunk_rows
    from llmscratch.training.memory import loss_workspace_bytes

    for device_type in ("cpu", "cuda"):
        rows = default_chunk_rows(50304, device_type)
        assert rows * 4 * 50304 <= CHUNK_BYTES[device_type] < (rows + 1) * 4 * 50304
    assert default_chunk_rows(50304, "mps") == default_chunk_rows(50304, "cpu")
    assert default_chunk_rows(10**9, "cuda") == 16  # never fewer rows than that
    config = GPTConfig(vocab_size=50304, d_model=64, n_layers=1, n_heads=2)
    assert loss_workspace_bytes(config, 16 * 1024, 2, "cuda") > 10 * loss_workspace_bytes(config, 16 * 1024, 2, "cpu")
