"""The feed-forward layers of a block: GPT-2's GELU MLP and the gated MLPs of Llama (SwiGLU) and Gemma (GeGLU)."""

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GATE_ACTIVATIONS", "GELUMLP", "SwiGLU"]


# What a gated MLP's gate goes through: SiLU (SwiGLU, Llama, Qwen, Mixtral) or the tanh GELU (GeGLU, Gemma)
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


GATE_ACTIVATIONS = {"silu": F.silu, "gelu": gelu_tanh}


class GELUMLP(nn.Module):
    """GPT-2's feed-forward layer: expand, GELU (tanh approximation), project back.

    squared_relu: max(0, x)^2 instead of GELU (the speedruns' choice; as sparse as ReLU, smooth at 0).
    """

    def __init__(self, d_model: int, hidden: int, bias: bool, squared_relu: bool = False):
        super().__init__()
        self.fc = nn.Linear(d_model, hidden, bias=bias)
        self.proj = nn.Linear(hidden, d_model, bias=bias)
        self.squared_relu = squared_relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc(x)  # (B, T, hidden)
        hidden = F.relu(hidden).square() if self.squared_relu else F.gelu(hidden, approximate="tanh")
        return self.proj(hidden)  # (B, T, d_model)


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
