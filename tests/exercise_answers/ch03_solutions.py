"""Worked answers to chapter 3's exercises, word for word the answer cells of ch03-architecture/solutions.ipynb.

Each ``# %%`` line starts one cell (the percent format that editors run as notebook cells);
``python -m llmscratch.exercises ch03 tests/exercise_answers/ch03_solutions.py`` passes every row.
"""

# %% imports
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from llmscratch.model.gpt import GPT


# %% swiglu
def swiglu(x, gate_weight, up_weight, down_weight):
    """Llama's feed-forward layer on x (..., d): down(silu(gate(x)) * up(x)), weights in nn.Linear's (out, in)."""
    gate = F.silu(x @ gate_weight.T)  # (..., hidden): the SiLU-activated gate, z * sigmoid(z)
    up = x @ up_weight.T  # (..., hidden): the values the gate lets through
    return (gate * up) @ down_weight.T  # (..., d)

# %% parameter_count
def parameter_count(config):
    """The number of parameters of GPT(config), a tied head counted once."""
    d, hidden = config.d_model, config.hidden_dim
    norm = 2 * d if config.norm == "layernorm" and config.bias else d  # gain, and LayerNorm's shift
    qkv_features = (config.n_heads + 2 * config.kv_heads) * config.head_dim  # [queries | keys | values]
    attention = d * qkv_features + config.qkv_bias * qkv_features + d * d + config.bias * d  # qkv, out_proj
    if config.mlp == "swiglu":
        mlp = 3 * d * hidden + config.bias * (2 * hidden + d)  # gate, up, down
    else:
        mlp = 2 * d * hidden + config.bias * (hidden + d)  # fc, proj
    block = 2 * norm + attention + mlp
    embeddings = config.vocab_size * d + (config.context_length * d if config.position == "learned" else 0)
    head = 0 if config.tie_embeddings else config.vocab_size * d  # a tied head is the embedding matrix
    return embeddings + config.n_layers * block + norm + head  # the final norm after the last block

# %% generate_greedy
def generate_greedy(model, idx, max_new_tokens):
    """idx (B, T) followed by max_new_tokens greedy tokens, (B, T + n): the prompt once, then one token a step."""
    tokens = idx
    if max_new_tokens == 0:
        return tokens
    caches = model.make_kv_caches(idx.size(0))  # one per block, as long as the context
    with torch.no_grad():
        logits = model(idx, caches)[:, -1]  # (B, V): the prompt fills positions 0 .. T - 1 of the caches
        for step in range(max_new_tokens):
            next_id = logits.argmax(dim=-1, keepdim=True)  # (B, 1)
            tokens = torch.cat([tokens, next_id], dim=1)  # (B, T + step + 1)
            if step < max_new_tokens - 1:  # the last token is returned, never fed back
                position = tokens.size(1) - 1  # where next_id sits, and goes in the caches
                logits = model(next_id, caches, start_pos=position)[:, -1]  # (B, V)
    return tokens

# %% SoftCappedHead
class SoftCappedHead(nn.Module):
    """An output head whose logits are squashed smoothly into (-cap, cap): cap * tanh(head(x) / cap)."""

    def __init__(self, head, cap):
        super().__init__()
        self.head, self.cap = head, cap  # the head itself, not a copy: a tied head stays tied

    def forward(self, x):
        return self.cap * torch.tanh(self.head(x) / self.cap)  # (..., V)

# %% ParallelBlock
class ParallelBlock(nn.Module):
    """A block whose attention and MLP both read one norm of x, and both add to it: x + attn(n(x)) + mlp(n(x))."""

    def __init__(self, block):
        super().__init__()
        self.norm, self.attn, self.mlp = block.attn_norm, block.attn, block.mlp  # block.mlp_norm is not used

    def forward(self, x, rope, kv_cache, start_pos, *, input_pos=None):
        normed = self.norm(x)  # (B, T, d): one norm for both branches
        attended = self.attn(normed, rope, kv_cache, start_pos, input_pos=input_pos)  # (B, T, d)
        return x + attended + self.mlp(normed)  # (B, T, d): the two branches side by side

# %% grow_vocabulary
def grow_vocabulary(model, new_vocab_size):
    """A new GPT with new_vocab_size ids: the old weights copied, every new row at the mean of the old rows."""
    old_size = model.config.vocab_size
    grown = GPT(dataclasses.replace(model.config, vocab_size=new_vocab_size))  # tied iff the config says so
    grown.train(model.training)
    state = grown.state_dict()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name in ("token_embedding.weight", "lm_head.weight"):  # (V, d): one row per token
                state[name][:old_size] = tensor
                state[name][old_size:] = tensor.mean(dim=0)  # neither favoured nor ignored at first
            else:
                state[name].copy_(tensor)
    return grown

# %% sliding_window_mask
def sliding_window_mask(input_pos, kv_len, window):
    """(T, kv_len) booleans: True where the query at position input_pos[t] may see the key at position s."""
    keys = torch.arange(kv_len)  # (kv_len,): the cache's positions
    back = input_pos[:, None] - keys  # (T, kv_len): how many steps back each key is
    return (back >= 0) & (back < window)  # not in the future, and fewer than `window` steps back

# %% route_top_k
def route_top_k(logits, k):
    """Each token's k experts (N, k), best first, their weights rescaled to sum to 1, and the balancing loss."""
    probs = torch.softmax(logits.float(), dim=-1)  # (N, E): over every expert
    weights, experts = probs.topk(k, dim=-1)  # (N, k)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    n_experts = logits.size(-1)
    share = torch.bincount(experts.flatten(), minlength=n_experts) / experts.numel()  # (E,): f_e, over N * k slots
    loss = n_experts * (share * probs.mean(dim=0)).sum()  # 1 for an even load; its gradient flows through P_e
    return weights, experts, loss

# %% PostNormBlock
class PostNormBlock(nn.Module):
    """A package Block with a norm after each sublayer as well: x + post(attn(norm(x))), then the same for the MLP."""

    def __init__(self, block):
        super().__init__()
        self.block = block
        d, eps = block.attn_norm.weight.size(0), block.attn_norm.eps
        self.attn_post_norm = type(block.attn_norm)(d, eps)  # RMSNorm, gains starting at 1
        self.mlp_post_norm = type(block.attn_norm)(d, eps)

    def forward(self, x, rope, kv_cache, start_pos, *, input_pos=None):
        b = self.block
        attended = b.attn(b.attn_norm(x), rope, kv_cache, start_pos, input_pos=input_pos)
        x = x + self.attn_post_norm(attended)  # normalised before it joins the stream
        return x + self.mlp_post_norm(b.mlp(b.mlp_norm(x)))
