"""Chapter 3's exercises: the GPT architecture, checked against ``llmscratch.model.gpt`` and
``llmscratch.model.generate``.

Write it yourself: a SwiGLU feed-forward layer from its three weight matrices, the parameter count of
any ``GPTConfig`` in closed form, and greedy decoding with the KV cache. Extend the package: a
soft-capped output head (Gemma 2), a parallel block (GPT-J, PaLM) and a grown vocabulary, each
plugged into ``GPT`` and checked through its forward pass, its loss and cached decoding. Section 9's
three (a sliding window's mask, top-k routing, post-norms) are in ``ch03_families``.
"""

import copy
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from llmscratch.exercises.ch03_fixtures import CHAPTER, LLAMA, VOCAB, build, decodes_exactly, ids, small_gpt
from llmscratch.exercises.checking import (attempt, diagnose, expect_close, expect_equal, fresh_generator, random_bool,
                                           random_float, random_int, random_seed)
from llmscratch.exercises.fixtures import calls_recorded
from llmscratch.model.config import GPTConfig
from llmscratch.model.generate import generate
from llmscratch.model.gpt import GPT
from llmscratch.model.mlp import SwiGLU


# --------------------------------------------------------------------------- write it yourself
def _swiglu_variant(x, gate, up, down, *, act=F.silu, on_up=False, transpose=True):
    """SwiGLU with each usual slip a switch: another activation, the gate on the wrong branch, x @ W."""
    gate, up, down = (w.T if transpose else w for w in (gate, up, down))
    g, u = x @ gate, x @ up  # (..., hidden) each
    return ((g * act(u)) if on_up else (act(g) * u)) @ down  # (..., d)


@CHAPTER.exercise("swiglu", title="SwiGLU from its three weight matrices", difficulty="warm-up",
                  section="2. The feed-forward layer: GELU and SwiGLU", kind="write it yourself",
                  forbidden=("llmscratch.model.mlp.SwiGLU",))
def check_swiglu(answer) -> int:
    generator, fresh = torch.Generator().manual_seed(32), fresh_generator()
    cases = [((1, 1, 1), 1), ((1, 2, 3), 3), ((1, 3, 4), 7), ((2, 5, 6), 16), ((3, 6), 5)]  # (shape of x, hidden)
    cases = [(*case, generator) for case in cases]  # and where the weights and x are drawn from
    for _ in range(3):  # and cases no table of the fixed ones holds
        shape = tuple(random_int(fresh, 1, 4) for _ in range(random_int(fresh, 1, 2))) + (random_int(fresh, 1, 8),)
        cases.append((shape, random_int(fresh, 1, 16), fresh))
    for shape, hidden, source in cases:
        d = shape[-1]
        mlp = SwiGLU(d, hidden, bias=False)
        with torch.no_grad():
            for layer in (mlp.gate, mlp.up, mlp.down):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=source))
            x = torch.randn(shape, generator=source)
            weights = (mlp.gate.weight, mlp.up.weight, mlp.down.weight)
            case = f"x of shape {shape}, gate and up of shape {(hidden, d)}, down of shape {(d, hidden)}"
            got = attempt(answer, x.clone(), *(w.clone() for w in weights), case=case)
            hint = diagnose(got, {
                "the SiLU goes on the gate projection, not on the up projection": lambda: _swiglu_variant(
                    x, *weights, on_up=True),
                "SwiGLU's gate is SiLU, z * sigmoid(z), not the sigmoid alone (that is the original GLU)":
                    lambda: _swiglu_variant(x, *weights, act=torch.sigmoid),
                "SwiGLU's gate is SiLU, not GELU (that would be GEGLU)": lambda: _swiglu_variant(x, *weights,
                                                                                                act=F.gelu),
                "the gate needs its activation: silu(gate(x)) * up(x), not gate(x) * up(x)":
                    lambda: _swiglu_variant(x, *weights, act=lambda z: z),
                "the weights are in nn.Linear's layout (out_features, in_features): apply each as x @ W.T":
                    lambda: _swiglu_variant(x, *weights, transpose=False),
            }, "compute down(silu(gate(x)) * up(x)), each weight applied as x @ W.T")
            expect_close(got, mlp(x), case=case, hint=hint, atol=1e-4)
    return len(cases)


def _count(c: GPTConfig, *, head_twice=False, kv_as_heads=False, mlp_matrices=None, norm_shift=None,
           positions=None, final_norm=True, hidden=None, qkv_bias=None) -> int:
    """The parameter count of GPT(c) in closed form; each keyword is one usual mistake."""
    d, head_dim, kv = c.d_model, c.head_dim, c.n_heads if kv_as_heads else c.kv_heads
    hidden = c.hidden_dim if hidden is None else hidden
    shift = c.norm == "layernorm" and c.bias if norm_shift is None else norm_shift
    norm = d * (2 if shift else 1)
    qkv_out = (c.n_heads + 2 * kv) * head_dim
    attention = d * qkv_out + qkv_out * (c.qkv_bias if qkv_bias is None else qkv_bias) + d * d + d * c.bias
    matrices = (3 if c.mlp == "swiglu" else 2) if mlp_matrices is None else mlp_matrices
    mlp = matrices * d * hidden + c.bias * ((matrices - 1) * hidden + d)
    learned = c.position == "learned" if positions is None else positions
    outside = c.vocab_size * d * (1 + (head_twice or not c.tie_embeddings)) + learned * c.context_length * d
    return outside + c.n_layers * (2 * norm + attention + mlp) + final_norm * norm


PARAMETER_CASES = [  # the fields of GPTConfig (or a preset's name), small and GPT-2-style first
    dict(vocab_size=10, context_length=4, d_model=4, n_layers=1, n_heads=1),
    dict(vocab_size=10, context_length=4, d_model=4, n_layers=2, n_heads=2, d_ff=6),
    dict(vocab_size=10, context_length=4, d_model=4, n_layers=1, n_heads=2, bias=False, qkv_bias=False),
    dict(vocab_size=10, context_length=4, d_model=4, n_layers=1, n_heads=2, bias=False),
    dict(vocab_size=10, context_length=6, d_model=4, n_layers=1, n_heads=2, tie_embeddings=False),
    dict(LLAMA, vocab_size=10, context_length=4, d_model=8, n_layers=1, n_heads=2, d_ff=12),
    dict(LLAMA, vocab_size=12, context_length=4, d_model=8, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=12,
         tie_embeddings=False),
    dict(LLAMA, vocab_size=12, context_length=4, d_model=8, n_layers=2, n_heads=4, n_kv_heads=1, d_ff=20),
    "gpt2-small", "llama-tiny", "tinyllama-1.1b",
]


def _fresh_config_fields(generator: torch.Generator) -> dict:
    """The fields of a random small GPTConfig, GPT-2 or Llama-style and anything between: a case no table holds."""
    def coin() -> bool:
        return random_bool(generator)

    n_kv_heads = random_int(generator, 1, 3)
    n_heads = n_kv_heads * random_int(generator, 1, 3)
    return dict(vocab_size=random_int(generator, 2, 100), context_length=random_int(generator, 1, 32),
                d_model=n_heads * 2 * random_int(generator, 1, 4), n_layers=random_int(generator, 1, 3),
                n_heads=n_heads, n_kv_heads=n_kv_heads, d_ff=random_int(generator, 1, 40) if coin() else None,
                norm=("layernorm", "rmsnorm")[coin()], mlp=("gelu", "swiglu")[coin()],
                position=("learned", "rope")[coin()], qkv_bias=coin(), bias=coin(), tie_embeddings=coin())


@CHAPTER.exercise("parameter_count", title="The parameter count of any GPTConfig", difficulty="medium",
                  section="6. Counting parameters and memory", kind="write it yourself",
                  forbidden=("llmscratch.model.gpt.GPT.num_params", "llmscratch.model.gpt.GPT"))
def check_parameter_count(answer) -> int:
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases = PARAMETER_CASES + [_fresh_config_fields(fresh) for _ in range(3)]
    for fields in cases:
        if isinstance(fields, str):
            config, case = GPTConfig.from_preset(fields), f"GPTConfig.from_preset({fields!r})"
        else:
            config = GPTConfig(**fields)
            case = f"GPTConfig({', '.join(f'{k}={v!r}' for k, v in fields.items())})"
        with torch.device("meta"):  # shapes without memory
            expected = GPT(config).num_params()
        got = attempt(answer, config, case=case)
        hint = diagnose(got, {
            "a tied head IS the token embedding matrix: count it once (a second vocab_size x d_model only "
            "when tie_embeddings is False)": lambda: _count(config, head_twice=True),
            "keys and values have n_kv_heads heads each (config.kv_heads): the qkv projection makes "
            "(n_heads + 2 * n_kv_heads) * head_dim features": lambda: _count(config, kv_as_heads=True),
            "SwiGLU has three matrices (gate, up, down), GELU's MLP two": lambda: _count(
                config, mlp_matrices=2 if config.mlp == "swiglu" else 3),
            "RMSNorm has only a gain (d_model), and LayerNorm a shift only when config.bias":
                lambda: _count(config, norm_shift=True),
            "the learned position table (context_length x d_model) is there only for position='learned'; "
            "RoPE has no parameters": lambda: _count(config, positions=config.position != "learned"),
            "count the final norm after the last block": lambda: _count(config, final_norm=False),
            "the MLP's hidden size is config.hidden_dim: d_ff when given, else 4 * d_model":
                lambda: _count(config, hidden=4 * config.d_model),
            "the qkv projection's bias follows config.qkv_bias, every other linear layer's config.bias":
                lambda: _count(config, qkv_bias=config.bias),
        }, "per block: two norms, qkv (d_model x (n_heads + 2 n_kv_heads) head_dim), out_proj, the MLP; around "
           "them: token table, learned positions, final norm, an untied head")
        expect_equal(got, expected, case=case, hint=hint)
    return len(cases)


def _greedy(model: GPT, idx: torch.Tensor, n: int, shift: int) -> torch.Tensor:
    """Greedy decoding with the cache, each new token fed at its position + shift (shift != 0: a slip)."""
    caches, tokens = model.make_kv_caches(idx.size(0)), idx
    with torch.no_grad():
        logits = model(idx, caches)[:, -1]  # (B, V)
        for step in range(n):
            tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)  # (B, T + step + 1)
            if step < n - 1:
                logits = model(tokens[:, -1:], caches, start_pos=tokens.size(1) - 1 + shift)[:, -1]
    return tokens


@CHAPTER.exercise("generate_greedy", title="Greedy decoding with the KV cache", difficulty="hard",
                  section="7. Generating text", kind="write it yourself",
                  forbidden=("llmscratch.model.generate.generate",))
def check_generate_greedy(answer) -> int:
    generator = torch.Generator().manual_seed(37)
    cases = [(False, 1, 1, 1), (False, 1, 1, 3), (True, 1, 2, 5), (False, 2, 3, 4), (True, 3, 4, 6),
             (False, 1, 5, 11)]  # (Llama-style?, B, prompt length T, new tokens n); the last fills the context
    cases = [(index, *case, generator) for index, case in enumerate(cases)]  # the weights' seed first, the ids' source
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_seed(fresh), random_bool(fresh), random_int(fresh, 1, 3), random_int(fresh, 1, 8),
               random_int(fresh, 1, 8), fresh) for _ in range(2)]  # at most 16 positions: the context
    for seed, llama, batch, prompt_len, n, source in cases:
        model, idx = small_gpt(llama, seed=seed), ids(batch, prompt_len, source)
        case = f"a {'Llama-style' if llama else 'GPT-2'} model, idx of shape {(batch, prompt_len)}, max_new_tokens={n}"
        expected = generate(model, idx, n)  # (B, T + n)
        with calls_recorded(model) as calls:  # the (B, T) of each call of the model
            got = attempt(answer, model, idx.clone(), n, case=case)
        hint = diagnose(got, {
            "return the prompt followed by the new tokens, (B, T + max_new_tokens)": lambda: expected[:, prompt_len:],
            "the token chosen after a prompt of T tokens sits at position T: feed it with start_pos=T (then T + 1, "
            "...), where it goes in the cache, not where the last cached one is": lambda: _greedy(model, idx, n, -1),
        }, "prefill the prompt with the caches, then feed each chosen token (B, 1) at its own position; the next "
           "token is the argmax of the last position's logits")
        expect_equal(got, expected, case=case, hint=hint)
        total, cached = sum(seq_len for _, seq_len in calls), prompt_len + n - 1
        hint = diagnose(total, {
            "with the KV cache each step feeds only the newest token, not the whole sequence again":
                lambda: sum(range(prompt_len, prompt_len + n)),
            "the last new token is never fed back: after the prefill, n new tokens need n - 1 decoding steps":
                lambda: prompt_len + n,
        }, "run the prompt once (model(idx, caches)), then one position per decoding step")
        expect_equal(total, cached, case=f"{case}: positions run through the model", hint=hint)
    return len(cases)


# --------------------------------------------------------------------------- extend the package
@CHAPTER.exercise("SoftCappedHead", title="A soft-capped output head (Gemma 2)", difficulty="warm-up",
                  section="5. The model", kind="extend the package")
def check_soft_capped_head(answer) -> int:
    generator = torch.Generator().manual_seed(35)
    cases = [(False, 1, 1, 1.0), (False, 2, 5, 5.0), (True, 1, 3, 2.0), (True, 2, 7, 30.0)]  # (Llama?, B, T, cap)
    cases = [(index, *case, generator) for index, case in enumerate(cases)]  # the weights' seed first, the ids' source
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_seed(fresh), random_bool(fresh), random_int(fresh, 1, 2), random_int(fresh, 1, 8),
               random_float(fresh, 0.5, 30.0, 1), fresh) for _ in range(2)]
    for seed, llama, batch, seq_len, cap, source in cases:
        model, idx = small_gpt(llama, seed=seed), ids(batch, seq_len, source)
        case = f"a {'Llama-style' if llama else 'GPT-2 (tied head)'} model, idx of shape {(batch, seq_len)}, cap={cap}"
        with torch.no_grad():
            plain, count = model(idx), model.num_params()  # (B, T, V)
        head = model.lm_head
        model.lm_head = build(answer, head, cap, case=case)
        expect_equal(sorted(id(p) for p in model.lm_head.parameters()), [id(head.weight)], case=case, hint=(
            "keep the head you are given as a submodule and add no parameters; a copy would untie it from the "
            "token embedding"))
        with torch.no_grad():
            got = attempt(model, idx, case=case)
        hint = diagnose(got, {
            "multiply back by cap: cap * tanh(logits / cap) keeps small logits as they were":
                lambda: torch.tanh(plain / cap),
            "divide by cap inside the tanh: cap * tanh(logits / cap)": lambda: cap * torch.tanh(plain),
            "a hard clamp has no gradient beyond the cap: use the smooth cap * tanh(logits / cap)":
                lambda: plain.clamp(-cap, cap),
        }, "the logits must be cap * tanh(head(x) / cap)")
        expect_close(got, cap * torch.tanh(plain / cap), case=case, hint=hint)
        targets = torch.randint(VOCAB, (batch, seq_len), generator=source)
        targets[0, 0] = -100  # a skipped target
        loss = attempt(model, idx, targets=targets, case=f"{case}: model(idx, targets=...)")
        expect_close(loss, F.cross_entropy(got.flatten(0, 1), targets.flatten()), case=f"{case}: the loss",
                     hint="the loss path calls your head on (N, d_model) rows: work on any leading shape")
        expect_equal(model.num_params(), count, case=case, hint="the model's parameter count must not change")
    return len(cases)


def _parallel(block, x, rope, *, sequential=False, mlp_norm=False, residual=True):
    """x + attn(norm(x)) + mlp(norm(x)), the usual slips as switches."""
    with torch.no_grad():
        attended = block.attn(block.attn_norm(x), rope)  # (B, T, d)
        mlp_input = x + attended if sequential else x
        mlp = block.mlp((block.mlp_norm if mlp_norm or sequential else block.attn_norm)(mlp_input))
        return (x if residual else 0) + attended + mlp


@CHAPTER.exercise("ParallelBlock", title="A parallel block: attention and MLP side by side (GPT-J, PaLM)",
                  difficulty="medium", section="4. The block", kind="extend the package")
def check_parallel_block(answer) -> int:
    generator = torch.Generator().manual_seed(34)
    cases = [(False, 1, 1), (False, 2, 5), (True, 1, 4), (True, 2, 9)]  # (Llama-style?, B, T)
    cases = [(10 + index, *case, generator) for index, case in enumerate(cases)]  # the weights' seed, x's source
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_seed(fresh), random_bool(fresh), random_int(fresh, 1, 2), random_int(fresh, 1, 9), fresh)
              for _ in range(2)]
    for seed, llama, batch, seq_len, source in cases:
        model, idx = small_gpt(llama, seed=seed), ids(batch, seq_len, source)
        case = f"a {'Llama-style' if llama else 'GPT-2'} block, x of shape {(batch, seq_len, 16)}"
        block, x = model.blocks[0], torch.randn(batch, seq_len, 16, generator=source)
        module = build(answer, block, case=case)
        got = attempt(module, x, model.rope, None, 0, case=case)
        hint = diagnose(got, {
            "that is the sequential block: both branches read the same normed x, neither sees the other's output":
                lambda: _parallel(block, x, model.rope, sequential=True),
            "one norm for both branches: the MLP also reads block.attn_norm(x)":
                lambda: _parallel(block, x, model.rope, mlp_norm=True),
            "add both branches to x, the residual stream": lambda: _parallel(block, x, model.rope, residual=False),
        }, "the output must be x + attn(attn_norm(x)) + mlp(attn_norm(x))")
        expect_close(got, _parallel(block, x, model.rope), case=case, hint=hint)
        model.blocks = nn.ModuleList([build(answer, b, case=case) for b in model.blocks])
        decodes_exactly(model, idx, f"a {'Llama-style' if llama else 'GPT-2'} model of parallel blocks, idx of "
                         f"shape {(batch, seq_len)}", "pass kv_cache, start_pos and input_pos on to block.attn: "
                         "cached decoding must give the logits of one full pass")
    return len(cases)


@CHAPTER.exercise("grow_vocabulary", title="Grow a model's vocabulary for new tokens", difficulty="hard",
                  section="5. The model", kind="extend the package")
def check_grow_vocabulary(answer) -> int:
    generator = torch.Generator().manual_seed(36)
    cases = [(False, 48, 1, 1), (False, 49, 2, 5), (True, 50, 1, 3), (True, 64, 2, 6), (True, 48, 1, 2)]
    cases = [(20 + index, *case, generator) for index, case in enumerate(cases)]  # the weights' seed, the ids' source
    fresh = fresh_generator()  # and cases no table of the fixed ones holds
    cases += [(random_seed(fresh), random_bool(fresh), random_int(fresh, VOCAB, 80), random_int(fresh, 1, 2),
               random_int(fresh, 1, 8), fresh) for _ in range(2)]
    for seed, llama, new_size, batch, seq_len, source in cases:  # (Llama-style, untied?, new vocab, B, T)
        model = small_gpt(llama, seed=seed)
        before, idx = copy.deepcopy(model.state_dict()), ids(batch, seq_len, source)
        case = (f"a {'Llama-style (untied head)' if llama else 'GPT-2 (tied head)'} model of vocab_size={VOCAB}, "
                f"new_vocab_size={new_size}, idx of shape {(batch, seq_len)}")
        grown = attempt(answer, model, new_size, case=case)
        unchanged = all(torch.equal(t, before[k]) for k, t in model.state_dict().items()) and len(before) == len(
            model.state_dict()) and model.config.vocab_size == VOCAB
        expect_equal(unchanged, True, case=case, hint="leave the model you are given as it was: build a new GPT")
        expect_equal(isinstance(grown, GPT), True, case=case, hint="return a GPT, built from the grown config")
        expect_equal(grown.config, dataclasses.replace(model.config, vocab_size=new_size), case=case,
                     hint="only the config's vocab_size changes: dataclasses.replace(model.config, vocab_size=...)")
        expect_equal(grown.lm_head.weight is grown.token_embedding.weight, model.config.tie_embeddings, case=case,
                     hint="keep the head tied to the embedding exactly when the config says tie_embeddings")
        table = model.token_embedding.weight.detach()  # (V, d)
        got_rows = grown.token_embedding.weight.detach()[VOCAB:]  # (new - V, d)
        hint = diagnose(got_rows, {"start the new rows at the mean of the old ones, not at zero: a zero "
                                   "embedding gives the new token no direction": lambda: torch.zeros_like(got_rows)},
                        "every new row of the token embedding starts at the mean of the old rows")
        expect_close(got_rows, table.mean(0).expand_as(got_rows), case=f"{case}: the new embedding rows", hint=hint)
        with torch.no_grad():
            old_logits, logits = model(idx), attempt(grown, idx, case=case)  # (B, T, V), (B, T, new)
        expect_close(logits[..., :VOCAB], old_logits,
                     case=f"{case}: the old tokens' logits", hint="copy every old weight, the head's old rows too")
        expect_close(logits[..., VOCAB:], old_logits.mean(-1, keepdim=True).expand(batch, seq_len, new_size - VOCAB),
                     case=f"{case}: the new tokens' logits", hint="the head's new rows start at the mean of its old "
                     "rows too, so that a new token starts with the average logit of the old ones")
        new_ids = torch.arange(new_size - 1, new_size - 1 - seq_len, -1).clamp(min=0)[None]  # (1, T): the new end
        expect_equal(tuple(attempt(grown, new_ids, case=f"{case}, new ids {new_ids.tolist()}").shape),
                     (1, seq_len, new_size), case=case, hint="the grown model must take ids up to new_vocab_size - 1")
    return len(cases)


from llmscratch.exercises import ch03_families  # noqa: E402, F401  (section 9's exercises register after these)
