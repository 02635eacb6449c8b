"""The feed-forward layers of a block: GPT-2's GELU MLP, the same shape through squared ReLU (the speedruns', and
pretrain.py's default), and the gated MLPs of Llama (SwiGLU) and Gemma (GeGLU)."""

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GATE_ACTIVATIONS", "GELUMLP", "MLP", "SquaredReLUMLP", "SwiGLU"]


# What a gated MLP's gate goes through: SiLU (SwiGLU, Llama, Qwen, Mixtral) or the tanh GELU (GeGLU, Gemma)
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


GATE_ACTIVATIONS = {"silu": F.silu, "gelu": gelu_tanh}


class MLP(nn.Module):
    """The plain feed-forward layer: expand to ``hidden``, an activation, project back (two matrices).

    Its subclasses name the activation, so a printed model says what its MLP computes.
    """

    def __init__(self, d_model: int, hidden: int, bias: bool):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.proj = nn.Linear(hidden, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.activation(self.fc(x))  # (B, T, hidden)
        return self.proj(hidden)  # (B, T, d_model)


class GELUMLP(MLP):
    """GPT-2's feed-forward layer: expand, GELU (tanh approximation), project back."""

    def activation(self, hidden: torch.Tensor) -> torch.Tensor:
        return gelu_tanh(hidden)


class SquaredReLUMLP(MLP):
    """GPT-2's two matrices with max(0, x)^2 in place of GELU (Primer, So et al. 2021; the speedruns' choice and
    pretrain.py's default): as sparse as ReLU, smooth at 0."""

    def activation(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.relu(hidden).square()


class SwiGLU(nn.Module):
    """Llama's feed-forward layer: a SiLU-activated gate multiplies a second projection.

    activation="gelu": the gate goes through the tanh GELU instead, which makes it GeGLU (Gemma).
    """

    def __init__(self, d_model: int, hidden: int, bias: bool, activation: str = "silu"):
        super().__init__()
        self.gate = nn.Linear(d_model, hidden, bias=bias)
        self.up = nn.Linear(d_model, hidden, bias=bias)
        self.down = nn.Linear(hidden, d_model, bias=bias)
        self.activation = activation
        self.act = GATE_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))  # (B, T, d_model)

    def extra_repr(self) -> str:
        return "" if self.activation == "silu" else f"activation={self.activation}"
