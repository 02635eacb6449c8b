"""A mixture of experts: the MLP of Mixtral, Qwen3-MoE and DeepSeek-MoE, built from many small gated MLPs.

A router scores each token against every expert; the token goes through its k best experts
only, and their outputs are mixed by the router's weights. The model holds n_experts MLPs' worth
of weights but spends k of them per token: more parameters at the same compute. No token is
dropped (no capacity limit): each expert takes however many tokens chose it, so the output does
not depend on what else is in the batch.

A router left alone sends most tokens to a few experts, which then learn fastest and attract
more. The load-balancing loss of the Switch Transformer pushes back: n_experts * sum_e f_e * P_e,
with f_e the share of routed slots that went to expert e and P_e its mean router probability,
is 1 when the load is even and grows as it concentrates.
"""

import torch
import torch.nn.functional as F
from torch import nn

from llmscratch.model.mlp import GATE_ACTIVATIONS, SwiGLU

__all__ = ["MoE", "Router", "balance_loss", "expert_load", "route"]


class Router(nn.Module):
    """One row of weights per expert: a token's score for each expert is its dot product with that row."""

    def __init__(self, d_model: int, n_experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_model))  # not an nn.Linear: LoRA leaves it alone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)  # (N, n_experts)


def route(logits: torch.Tensor, k: int, norm_topk: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's k experts and their weights (N, k), and every expert's probability (N, E), from router logits.

    The softmax runs over all experts in float32 (what Mixtral and Qwen3-MoE do); norm_topk rescales the k
    chosen probabilities to sum to 1.
    """
    probs = logits.float().softmax(dim=-1)  # (N, E)
    weights, experts = probs.topk(k, dim=-1)  # (N, k) each, best first
    if norm_topk:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts, probs


def balance_loss(probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The Switch Transformer's load-balancing loss: n_experts * sum_e (share of slots to e) * (mean prob of e).

    1 for an even load (or a router that puts its probability where the tokens do not go); n_experts when
    every token goes to one expert that takes all the probability. Its gradient reaches the router
    through the probabilities only: the choice itself is not differentiable.
    """
    n_experts = probs.size(-1)
    share = torch.bincount(experts.flatten(), minlength=n_experts).to(probs.dtype) / experts.numel()  # (E,)
    return n_experts * (share * probs.mean(dim=0)).sum()  # ()


class MoE(nn.Module):
    """n_experts gated MLPs (SwiGLU, or GeGLU with activation="gelu"), k of them per token, plus optional shared
    experts every token goes through.

    The experts' weights are stacked, expert first: gate and up (E, d_expert, d_model), down (E, d_model, d_expert);
    ``self.gate[e]`` is expert e's matrix, whether a parameter or (quantized) integers dequantized on reading.
    After each forward in training mode, ``aux_loss`` holds the load-balancing loss (with its gradient) and
    ``load`` adds up the tokens each expert received (the router's statistics, for logging).
    """

    def __init__(self, d_model: int, d_expert: int, n_experts: int, k: int, *, norm_topk: bool = True,
                 shared_experts: int = 0, activation: str = "silu"):
        super().__init__()
        if not 1 <= k <= n_experts:
            raise ValueError(f"k must be between 1 and n_experts={n_experts}, got k={k}")
        self.n_experts, self.k, self.norm_topk = n_experts, k, norm_topk
        self.act = GATE_ACTIVATIONS[activation]
        self.router = Router(d_model, n_experts)
        self.gate = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.up = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.down = nn.Parameter(torch.empty(n_experts, d_model, d_expert))
        self.shared = None
        if shared_experts:
            self.shared = SwiGLU(d_model, shared_experts * d_expert, bias=False, activation=activation)
        for weight in (self.router.weight, self.gate, self.up, self.down):
            nn.init.normal_(weight, std=0.02)
        self.aux_loss: torch.Tensor | None = None
        self.load: torch.Tensor | None = None  # (E,) tokens routed to each expert since the last reset_load()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])  # (N, d)
        weights, experts, probs = route(self.router(tokens), self.k, self.norm_topk)  # (N, k), (N, k), (N, E)
        out = self.dispatch(tokens, weights.to(x.dtype), experts)  # (N, d)
        if self.shared is not None:
            out = out + self.shared(tokens)
        if self.training:
            self.aux_loss = balance_loss(probs, experts)
            with torch.no_grad():
                counts = torch.bincount(experts.flatten(), minlength=self.n_experts)  # (E,)
                # a plain attribute, which .to(device) does not move: the count so far follows the tokens
                self.load = counts if self.load is None else self.load.to(counts.device) + counts
        return out.reshape(shape)

    def dispatch(self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Each token through its k experts, mixed by ``weights`` (N, k): (N, d).

        The N * k (token, expert) pairs are sorted by expert, so that each expert runs once on the rows that
        chose it, however many (none is skipped, none dropped).
        """
        if experts.numel() < self.n_experts and not torch.is_grad_enabled():  # decoding: fewer slots than experts
            return self._dispatch_slots(tokens, weights, experts)
        slots = experts.flatten()  # (N * k,) token t's j-th expert at t * k + j
        order = slots.argsort(stable=True)  # the slots grouped by expert
        counts = torch.bincount(slots, minlength=self.n_experts).tolist()  # on the host: each expert's slice
        rows = order // self.k  # (N * k,) the token of each sorted slot
        mix = weights.flatten()[order, None]  # (N * k, 1)
        out = torch.zeros_like(tokens)  # (N, d)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                picked = rows[start:start + count]  # (n_e,)
                h = tokens[picked]  # (n_e, d)
                hidden = self.act(F.linear(h, self.gate[expert])) * F.linear(h, self.up[expert])  # (n_e, d_expert)
                out.index_add_(0, picked, F.linear(hidden, self.down[expert]) * mix[start:start + count])
            start += count
        idle = [expert for expert, count in enumerate(counts) if not count]
        if idle and torch.is_grad_enabled():  # a zero gradient for the experts no token chose, not none: DDP
            out = out + 0 * sum(w[idle].sum() for w in (self.gate, self.up, self.down))  # waits for every parameter
        return out

    def _dispatch_slots(self, tokens: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``dispatch`` for a few tokens: each row through its experts in increasing order (the order ``dispatch``
        adds them in), without sorting the slots."""
        rows = []
        for token, chosen, mix in zip(tokens[:, None], experts.tolist(), weights):  # (1, d), k ids, (k,)
            out = torch.zeros_like(token)
            for expert, j in sorted((expert, j) for j, expert in enumerate(chosen)):
                hidden = self.act(F.linear(token, self.gate[expert])) * F.linear(token, self.up[expert])
                out = out + F.linear(hidden, self.down[expert]) * mix[j]
            rows.append(out)
        return torch.cat(rows)  # (N, d)

    def __getstate__(self) -> dict:
        """What copy.deepcopy and pickle copy: the balancing loss without its graph (a tensor inside a graph
        cannot be copied, so a model copied after a training step, as DPO copies its reference, would fail)."""
        state = super().__getstate__()
        if state["aux_loss"] is not None:
            state["aux_loss"] = state["aux_loss"].detach()
        return state

    def reset_load(self) -> torch.Tensor | None:
        """The tokens each expert received since the last call (None if none trained), and start counting again."""
        load, self.load = self.load, None
        return load

    def extra_repr(self) -> str:
        return f"n_experts={self.n_experts}, k={self.k}, d_expert={self.gate.shape[1]}, norm_topk={self.norm_topk}"


def expert_load(model: nn.Module) -> list[list[float]] | None:
    """Each mixture-of-experts layer's share of the routed tokens per expert since the last call, and counting starts
    again; None for a model without one (or before any training step). This process's tokens only."""
    loads = [module.reset_load() for module in model.modules() if isinstance(module, MoE)]
    if not loads or any(load is None for load in loads):
        return None
    return [(load / load.sum()).tolist() for load in loads]
