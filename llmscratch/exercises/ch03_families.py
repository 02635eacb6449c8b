"""Chapter 3's exercises on section 9 (Gemma 3, Qwen3, mixtures of experts), registered with ``ch03``'s
``CHAPTER`` (``ch03_fixtures``).

Write it yourself: a sliding window's mask over a KV cache, and a router's top-k choice with its balancing
loss. Extend the package: a block with norms after its sublayers too (Gemma 2 and 3).
"""

import torch

from llmscratch.exercises.ch03_fixtures import CHAPTER, build, decodes_exactly, ids, small_gpt
from llmscratch.exercises.checking import (attempt, diagnose, expect_close, expect_equal, fresh_generator, random_int,
                                           random_seed)
from llmscratch.model.attention import positions_mask
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import Block
from llmscratch.model.moe import balance_loss, route

SECTION = "9. Beyond Llama: Gemma 3, Qwen3 and mixtures of experts"


@CHAPTER.exercise("sliding_window_mask", title="A sliding window's mask over a KV cache", difficulty="warm-up",
                  section=SECTION, kind="write it yourself",
                  forbidden=("llmscratch.model.attention.positions_mask", "llmscratch.model.attention.causal_mask"))
def check_sliding_window_mask(answer) -> int:
    cases = [([0], 1, 1), ([0, 1, 2], 3, 1), ([0, 1, 2, 3], 4, 2), ([5], 8, 3), ([3, 4, 5], 8, 2), ([2, 3], 6, 9),
             ([0, 1, 2, 3, 4, 5], 6, 4)]  # (the queries' positions, the cache's length, the window)
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    for _ in range(3):
        kv_len = random_int(fresh, 1, 12)
        first = random_int(fresh, 0, kv_len - 1)
        cases.append((list(range(first, random_int(fresh, first + 1, kv_len))), kv_len, random_int(fresh, 1, 6)))
    for positions, kv_len, window in cases:
        input_pos = torch.tensor(positions)
        case = f"input_pos={positions}, kv_len={kv_len}, window={window}"
        got = attempt(answer, input_pos.clone(), kv_len, window, case=case)
        keys = torch.arange(kv_len)

        def band(low_steps: int, causal: bool = True) -> torch.Tensor:
            distance = input_pos[:, None] - keys  # (T, kv_len): how far back each key is
            return ((distance >= 0) if causal else (distance > -low_steps)) & (distance < low_steps)

        hint = diagnose(got, {
            "a window of w covers the query's own position and the w - 1 before it: you let one more key in":
                lambda: band(window + 1),
            "a window of w covers the query's own position and the w - 1 before it: you kept one key too few":
                lambda: band(window - 1),
            "the window is still causal: no query sees a key after its own position":
                lambda: band(window, causal=False),
            "the window is ignored: hide the keys window or more positions back": lambda: positions_mask(
                input_pos, kv_len),
        }, "True where key s is at or before the query's position p and p - s < window")
        expect_equal(got, positions_mask(input_pos, kv_len, window), case=case, hint=hint)
    return len(cases)


def _route_variant(logits: torch.Tensor, k: int, *, renormalise=True, slots=True, experts_factor=True,
                   chosen_probs=False):
    """route + balance_loss with each usual slip a switch."""
    probs = logits.float().softmax(dim=-1)  # (N, E)
    weights, experts = probs.topk(k, dim=-1)  # (N, k)
    top = weights
    if renormalise:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    n_experts = probs.size(-1)
    counts = torch.bincount(experts.flatten(), minlength=n_experts).float()  # (E,)
    share = counts / (experts.numel() if slots else experts.size(0))
    if chosen_probs:  # the mean of the chosen weights only, zero where not chosen
        mean_prob = torch.zeros(logits.size(0), n_experts).scatter(1, experts, top).mean(dim=0)
    else:
        mean_prob = probs.mean(dim=0)
    loss = (n_experts if experts_factor else 1) * (share * mean_prob).sum()
    return weights, experts, loss


@CHAPTER.exercise("route_top_k", title="Top-k routing and its load-balancing loss", difficulty="medium",
                  section=SECTION, kind="write it yourself",
                  forbidden=("llmscratch.model.moe.route", "llmscratch.model.moe.balance_loss"))
def check_route_top_k(answer) -> int:
    generator = torch.Generator().manual_seed(39)
    cases = [(1, 2, 1), (3, 2, 2), (5, 4, 1), (6, 4, 2), (9, 8, 3), (4, 5, 5)]  # (N tokens, E experts, k)
    cases = [(*case, generator) for case in cases]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    for _ in range(3):
        n_experts = random_int(fresh, 2, 9)
        cases.append((random_int(fresh, 1, 12), n_experts, random_int(fresh, 1, n_experts), fresh))
    for n_tokens, n_experts, k, source in cases:
        logits = (torch.randn(n_tokens, n_experts, generator=source) * 2).requires_grad_()
        case = f"logits of shape {(n_tokens, n_experts)}, k={k}"
        got = attempt(answer, logits, k, case=case)
        expect_equal(isinstance(got, tuple) and len(got) == 3, True, case=case,
                     hint="return three things: (weights, experts, balance_loss)")
        weights, experts, loss = got
        expected_weights, expected_experts, probs = route(logits, k, norm_topk=True)
        expected_loss = balance_loss(probs, expected_experts)
        expect_equal(experts, expected_experts, case=f"{case}: the experts", hint=(
            "each token's k experts of highest probability, best first (torch.topk)"))
        hint = diagnose(weights, {
            "rescale the k chosen probabilities so that they sum to 1 (divide by their sum)":
                lambda: _route_variant(logits, k, renormalise=False)[0],
        }, "the weights are the softmax probabilities of the k chosen experts, rescaled to sum to 1")
        expect_close(weights, expected_weights, case=f"{case}: the weights", hint=hint)
        hint = diagnose(loss.detach() if isinstance(loss, torch.Tensor) else loss, {
            "f_e is the share of the N * k routed slots that went to e (each token has k of them), not of the N "
            "tokens": lambda: _route_variant(logits, k, slots=False)[2].detach(),
            "multiply by the number of experts: an even load scores 1": lambda: _route_variant(
                logits, k, experts_factor=False)[2].detach(),
            "P_e is the mean of expert e's probability over all tokens, the softmax over every expert, not only the "
            "chosen ones": lambda: _route_variant(logits, k, chosen_probs=True)[2].detach(),
        }, "the loss is n_experts * sum_e f_e * P_e")
        expect_close(loss, expected_loss, case=f"{case}: the balancing loss", hint=hint)
        grad_case = f"{case}: the loss's gradient with respect to the logits"
        grad_hint = ("the loss must reach the router through the probabilities P_e (f_e has no gradient): do not "
                     "detach them")
        expect_equal(loss.requires_grad, True, case=grad_case, hint=grad_hint)
        (expected_grad,) = torch.autograd.grad(expected_loss, logits)
        (got_grad,) = torch.autograd.grad(loss, logits, allow_unused=True)
        expect_close(got_grad, expected_grad, case=grad_case, hint=grad_hint)
    return len(cases)


def _post_normed(block, answer_norms, x, rope, *, sum_normed=False, mlp_post=True):
    """The block with post-norms (the norms given), the usual slips as switches."""
    attn_post, mlp_post_norm = answer_norms
    with torch.no_grad():
        attended = block.attn(block.attn_norm(x), rope)
        x = attn_post(x + attended) if sum_normed else x + attn_post(attended)
        out = block.mlp(block.mlp_norm(x))
        if sum_normed:
            return mlp_post_norm(x + out)
        return x + (mlp_post_norm(out) if mlp_post else out)


@CHAPTER.exercise("PostNormBlock", title="Norms after the sublayers too (Gemma 2 and 3)", difficulty="medium",
                  section=SECTION, kind="extend the package")
def check_post_norm_block(answer) -> int:
    generator = torch.Generator().manual_seed(40)
    cases = [(40 + index, batch, seq_len, generator) for index, (batch, seq_len) in enumerate([(1, 1), (2, 5),
                                                                                               (1, 9)])]
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_seed(fresh), random_int(fresh, 1, 2), random_int(fresh, 1, 9), fresh) for _ in range(2)]
    for seed, batch, seq_len, source in cases:
        model, idx = small_gpt(True, seed=seed), ids(batch, seq_len, source)
        block, x = model.blocks[0], torch.randn(batch, seq_len, 16, generator=source)
        case = f"a Llama-style block, x of shape {(batch, seq_len, 16)}"
        count = sum(p.numel() for p in block.parameters())
        module = build(answer, block, case=case)
        norms = [getattr(module, name, None) for name in ("attn_post_norm", "mlp_post_norm")]
        expect_equal(all(isinstance(n, torch.nn.Module) and getattr(n, "weight", None) is not None and
                         tuple(n.weight.shape) == (16,) for n in norms), True, case=case, hint=(
            "give the module two RMSNorm(d_model) submodules named attn_post_norm and mlp_post_norm"))
        expect_equal(sum(p.numel() for p in module.parameters()), count + 2 * 16, case=case, hint=(
            "keep the block's own modules and add the two norms' gains, nothing else"))
        reference = Block(GPTConfig(**{**model.config.to_dict(), "post_norms": True})).eval()
        with torch.no_grad():
            for norm in norms:
                norm.weight.copy_(1 + 0.3 * torch.randn(16, generator=source))  # gains that matter
            state = {**block.state_dict(), "attn_post_norm.weight": norms[0].weight,
                     "mlp_post_norm.weight": norms[1].weight}
            reference.load_state_dict(state)
        got = attempt(module, x, model.rope, None, 0, case=case)
        hint = diagnose(got, {
            "normalise the sublayer's output before it is added to x, not the sum (that is the original "
            "Transformer's post-LN)": lambda: _post_normed(block, norms, x, model.rope, sum_normed=True),
            "the MLP's output gets its post-norm too": lambda: _post_normed(block, norms, x, model.rope,
                                                                          mlp_post=False),
            "that is the block without post-norms": lambda: block(x, model.rope, None, 0),
        }, "the output must be x1 + mlp_post_norm(mlp(mlp_norm(x1))), x1 = x + attn_post_norm(attn(attn_norm(x)))")
        with torch.no_grad():
            expect_close(got, reference(x, model.rope, None, 0), case=case, hint=hint)
        model.blocks = torch.nn.ModuleList([build(answer, b, case=case) for b in model.blocks])
        decodes_exactly(model, idx, f"a Llama-style model of post-normed blocks, idx of shape {(batch, seq_len)}",
                         "pass kv_cache, start_pos and input_pos on to block.attn: cached decoding must give the "
                         "logits of one full pass")
    return len(cases)
