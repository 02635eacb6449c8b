"""Chapter 3's exercise checks: the worked answers pass, plausible wrong answers fail with the right hint."""

import copy

import torch
import torch.nn.functional as F
from exercise_suite import ExerciseSuite, solutions
from torch import nn

from llmscratch.exercises import ch03, ch03_fixtures
from llmscratch.model.gpt import GPT

sol = solutions(ch03)


def count_by_building_the_model(config):
    """GPT(...).num_params(): the count the exercise asks to derive from the config."""
    with torch.device("meta"):
        return GPT(config).num_params()


# --------------------------------------------------------------------------- wrong answers
def swiglu_with(act=F.silu, on_up=False, transposed=True):
    def swiglu(x, gate_weight, up_weight, down_weight):
        gate, up, down = (w.T if transposed else w for w in (gate_weight, up_weight, down_weight))
        return ((x @ gate) * act(x @ up) if on_up else act(x @ gate) * (x @ up)) @ down

    return swiglu


def count_with(slip):
    """parameter_count with one slip."""
    def parameter_count(c):
        total, d = sol.parameter_count(c), c.d_model
        if slip == "head twice" and c.tie_embeddings:
            total += c.vocab_size * d
        if slip == "kv as heads":
            total += 2 * c.n_layers * (c.n_heads - c.kv_heads) * c.head_dim * (d + c.qkv_bias)
        if slip == "no final norm":
            total -= d * (2 if c.norm == "layernorm" and c.bias else 1)
        if slip == "shift always" and not (c.norm == "layernorm" and c.bias):
            total += (2 * c.n_layers + 1) * d
        if slip == "two swiglu matrices" and c.mlp == "swiglu":
            total -= c.n_layers * d * c.hidden_dim
        return total

    return parameter_count


def greedy_with(slip):
    """generate_greedy with one slip: no cache, a last token fed back, positions one too early, no prompt."""
    def generate_greedy(model, idx, max_new_tokens):
        caches = None if slip == "no cache" else model.make_kv_caches(idx.size(0))
        tokens = idx
        with torch.no_grad():
            logits = model(idx, caches)[:, -1]
            for step in range(max_new_tokens):
                tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
                if slip == "no cache" and step < max_new_tokens - 1:
                    logits = model(tokens)[:, -1]
                elif slip != "no cache" and (step < max_new_tokens - 1 or slip == "feed the last"):
                    shift = -1 if slip == "one too early" else 0
                    logits = model(tokens[:, -1:], caches, start_pos=tokens.size(1) - 1 + shift)[:, -1]
        return tokens[:, idx.size(1):] if slip == "no prompt" else tokens

    return generate_greedy


def capped_with(slip):
    class SoftCappedHead(nn.Module):
        def __init__(self, head, cap):
            super().__init__()
            self.head, self.cap = copy.deepcopy(head) if slip == "copy" else head, cap

        def forward(self, x):
            z = self.head(x)
            if slip == "clamp":
                return z.clamp(-self.cap, self.cap)
            return {"tanh only": torch.tanh(z / self.cap), "no division": self.cap * torch.tanh(z),
                    "copy": self.cap * torch.tanh(z / self.cap)}[slip]

    return SoftCappedHead


def parallel_with(slip):
    class ParallelBlock(nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, rope, kv_cache, start_pos, *, input_pos=None):
            b = self.block
            normed = b.attn_norm(x)
            attended = (b.attn(normed, rope) if slip == "no cache" else
                        b.attn(normed, rope, kv_cache, start_pos, input_pos=input_pos))
            mlp = b.mlp(b.mlp_norm(x) if slip == "two norms" else normed)
            return attended + mlp if slip == "no residual" else x + attended + mlp

    return ParallelBlock


def grow_with(slip):
    """grow_vocabulary with one slip."""
    def grow_vocabulary(model, new_vocab_size):
        grown = sol.grow_vocabulary(model, new_vocab_size)
        if slip == "in place":
            model.token_embedding = grown.token_embedding
        old = model.token_embedding.weight.size(0)
        with torch.no_grad():
            if slip == "zeros":
                grown.token_embedding.weight[old:] = 0.0
            if slip == "untied":
                grown.lm_head.weight = nn.Parameter(grown.token_embedding.weight.detach().clone())
            if slip == "head left at init" and not grown.config.tie_embeddings:
                grown.lm_head.weight[old:].normal_(0.0, 0.02)
        return grown

    return grow_vocabulary


def window_with(slip):
    """sliding_window_mask with one slip: one key too many or too few, both ways, no window at all."""
    def sliding_window_mask(input_pos, kv_len, window):
        back = input_pos[:, None] - torch.arange(kv_len)  # (T, kv_len)
        return {"one more": (back >= 0) & (back <= window), "one fewer": (back >= 0) & (back < window - 1),
                "both ways": back.abs() < window, "no window": back >= 0}[slip]

    return sliding_window_mask


def window_as(kind):
    """The right window, as numbers: 0/1 floats, an additive mask of 0 and -inf, 0/1 integers."""
    def sliding_window_mask(input_pos, kv_len, window):
        back = input_pos[:, None] - torch.arange(kv_len)  # (T, kv_len)
        allowed = (back >= 0) & (back < window)
        if kind == "additive":
            return torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        return allowed.to({"float": torch.float32, "long": torch.long}[kind])

    return sliding_window_mask


def window_by_tril(input_pos, kv_len, window):
    """Right, written differently: a band of tril and triu over the full square, its rows of the queries taken."""
    square = torch.ones(kv_len, kv_len, dtype=torch.bool)
    return (square.tril() & square.triu(-(window - 1)))[input_pos]


def route_with(slip):
    """route_top_k with one slip: weights not rescaled, f_e over tokens, no n_experts factor, P_e detached."""
    def route_top_k(logits, k):
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = probs.topk(k, dim=-1)
        if slip != "not rescaled":
            weights = weights / weights.sum(dim=-1, keepdim=True)
        n_experts = logits.size(-1)
        counts = torch.bincount(experts.flatten(), minlength=n_experts)
        share = counts / (experts.size(0) if slip == "over tokens" else experts.numel())
        mean_prob = (probs.detach() if slip == "detached" else probs).mean(dim=0)
        return weights, experts, (1 if slip == "no factor" else n_experts) * (share * mean_prob).sum()

    return route_top_k


def post_norm_with(slip):
    """PostNormBlock with one slip: the sum normed (post-LN), the MLP without its post-norm, the cache dropped."""
    class PostNormBlock(sol.PostNormBlock):
        def forward(self, x, rope, kv_cache, start_pos, *, input_pos=None):
            b = self.block
            if slip == "no cache":
                kv_cache, start_pos, input_pos = None, 0, None
            attended = b.attn(b.attn_norm(x), rope, kv_cache, start_pos, input_pos=input_pos)
            if slip == "post-LN":
                x = self.attn_post_norm(x + attended)
                return self.mlp_post_norm(x + b.mlp(b.mlp_norm(x)))
            x = x + self.attn_post_norm(attended)
            out = b.mlp(b.mlp_norm(x))
            return x + (out if slip == "attention only" else self.mlp_post_norm(out))

    return PostNormBlock


TIED = "a GPT-2 (tied head) model of vocab_size=48"
UNTIED = "a Llama-style (untied head) model of vocab_size=48"
WRONG = [  # (exercise, wrong answer, the smallest failing input it must report, the hint it must get)
    ("swiglu", swiglu_with(on_up=True), "x of shape (1, 1, 1)", "not on the up projection"),
    ("swiglu", swiglu_with(act=torch.sigmoid), "x of shape (1, 1, 1)", "not the sigmoid alone"),
    ("swiglu", swiglu_with(act=F.gelu), "x of shape (1, 2, 3)", "GEGLU"),
    ("swiglu", swiglu_with(transposed=False), "x of shape (1, 2, 3)", "apply each as x @ W.T"),
    ("parameter_count", count_with("head twice"), "GPTConfig(vocab_size=10, context_length=4, d_model=4, "
     "n_layers=1, n_heads=1)", "count it once"),
    ("parameter_count", count_by_building_the_model, "n_layers=1, n_heads=1)", "write it without GPT(...)"),
    ("parameter_count", count_with("kv as heads"), "n_kv_heads=2", "n_kv_heads heads each"),
    ("parameter_count", count_with("no final norm"), "n_layers=1, n_heads=1)", "count the final norm"),
    ("parameter_count", count_with("shift always"), "bias=False, qkv_bias=False", "LayerNorm a shift only"),
    ("parameter_count", count_with("two swiglu matrices"), "norm='rmsnorm'", "SwiGLU has three matrices"),
    ("generate_greedy", greedy_with("no cache"), "idx of shape (1, 1), max_new_tokens=3: positions run",
     "not the whole sequence"),
    ("generate_greedy", greedy_with("feed the last"), "idx of shape (1, 1), max_new_tokens=1: positions run",
     "never fed back"),
    ("generate_greedy", greedy_with("one too early"), "idx of shape (1, 2), max_new_tokens=5", "feed it with start_pos=T"),
    ("generate_greedy", greedy_with("no prompt"), "idx of shape (1, 1), max_new_tokens=1",
     "the prompt followed by the new tokens"),
    ("SoftCappedHead", capped_with("tanh only"), "GPT-2 (tied head) model, idx of shape (2, 5), cap=5.0",
     "multiply back by cap"),
    ("SoftCappedHead", capped_with("no division"), "cap=5.0", "divide by cap inside the tanh"),
    ("SoftCappedHead", capped_with("clamp"), "cap=1.0", "a hard clamp has no gradient"),
    ("SoftCappedHead", capped_with("copy"), "idx of shape (1, 1), cap=1.0", "a copy would untie it"),
    ("ParallelBlock", lambda block: block, "a GPT-2 block, x of shape (1, 1, 16)", "that is the sequential block"),
    ("ParallelBlock", parallel_with("two norms"), "a GPT-2 block, x of shape (1, 1, 16)", "one norm for both"),
    ("ParallelBlock", parallel_with("no residual"), "x of shape (1, 1, 16)", "add both branches to x"),
    ("ParallelBlock", parallel_with("no cache"), "model of parallel blocks, idx of shape (2, 5): prefill 2 tokens",
     "pass kv_cache, start_pos and input_pos"),
    ("grow_vocabulary", grow_with("zeros"), f"{TIED}, new_vocab_size=49", "not at zero"),
    ("grow_vocabulary", grow_with("in place"), f"{TIED}, new_vocab_size=49", "leave the model you are given"),
    ("grow_vocabulary", grow_with("untied"), f"{TIED}, new_vocab_size=48", "keep the head tied"),
    ("grow_vocabulary", grow_with("head left at init"), f"{UNTIED}, new_vocab_size=50",
     "the head's new rows start at the mean"),
    ("sliding_window_mask", window_with("one more"), "input_pos=[0, 1, 2], kv_len=3, window=1", "one more key in"),
    ("sliding_window_mask", window_with("one fewer"), "input_pos=[0], kv_len=1, window=1", "one key too few"),
    ("sliding_window_mask", window_with("both ways"), "input_pos=[0, 1, 2, 3], kv_len=4, window=2",
     "still causal"),
    ("sliding_window_mask", window_with("no window"), "input_pos=[0, 1, 2], kv_len=3, window=1",
     "the window is ignored"),
    ("sliding_window_mask", window_as("float"), "input_pos=[0], kv_len=1, window=1", "return booleans"),
    ("sliding_window_mask", window_as("additive"), "input_pos=[0], kv_len=1, window=1", "an additive mask"),
    ("sliding_window_mask", window_as("long"), "input_pos=[0], kv_len=1, window=1", "return booleans"),
    ("route_top_k", route_with("not rescaled"), "logits of shape (1, 2), k=1: the weights", "sum to 1"),
    ("route_top_k", route_with("over tokens"), "logits of shape (3, 2), k=2: the balancing loss",
     "not of the N tokens"),
    ("route_top_k", route_with("no factor"), "logits of shape (1, 2), k=1: the balancing loss",
     "multiply by the number of experts"),
    ("route_top_k", route_with("detached"), "logits of shape (1, 2), k=1: the loss's gradient", "do not detach"),
    ("PostNormBlock", post_norm_with("post-LN"), "a Llama-style block, x of shape (1, 1, 16)",
     "not the sum (that is the original Transformer's post-LN)"),
    ("PostNormBlock", post_norm_with("attention only"), "a Llama-style block, x of shape (1, 1, 16)",
     "the MLP's output gets its post-norm too"),
    ("PostNormBlock", post_norm_with("no cache"), "post-normed blocks, idx of shape (2, 5): prefill 2 tokens",
     "pass kv_cache, start_pos and input_pos"),
]


class TestChapter3(ExerciseSuite):
    chapter, folder, wrong = ch03, "ch03-architecture", WRONG


# --------------------------------------------------------------------------- chapter 3 only
def verdict(answer, name):
    return ch03.CHAPTER.check(answer, name, quiet=True)


def test_an_answer_that_raises_or_is_no_module_is_a_verdict_not_a_traceback():
    assert "subclass torch.nn.Module" in verdict(lambda head, cap: "a head", "SoftCappedHead").detail
    assert "ZeroDivisionError" in verdict(lambda model, idx, n: 1 / 0, "generate_greedy").detail
    assert "return a GPT" in verdict(lambda model, size: model.state_dict(), "grow_vocabulary").detail
    assert "a tensor" in verdict(lambda x, *weights: [1.0], "swiglu").detail


def test_the_closed_form_of_the_usual_mistakes_starts_from_the_package_count():
    for fields in ch03.PARAMETER_CASES[:-3]:
        config = ch03.GPTConfig(**fields)
        with torch.device("meta"):
            assert ch03._count(config) == ch03.GPT(config).num_params() == sol.parameter_count(config)


def test_the_greedy_cases_generate_more_than_one_token_value():
    model = ch03_fixtures.small_gpt(True, seed=4)
    idx = torch.tensor([[1, 2, 3, 47]])
    assert len(set(ch03.generate(model, idx, 10)[0, 4:].tolist())) > 2  # a check on repeats would be no check


def test_a_sliding_window_written_with_tril_and_triu_passes():
    assert ch03.CHAPTER.check(window_by_tril, "sliding_window_mask", quiet=True).status == "passed"
