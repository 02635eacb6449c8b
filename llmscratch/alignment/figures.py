"""Chapter 6's figure: the DPO loss against the log-ratio margin, each point from ``dpo_loss``."""

from collections.abc import Sequence

import torch
from matplotlib.figure import Figure

from llmscratch.alignment.preference import dpo_loss


def draw_dpo_loss(betas: Sequence[float], margins: torch.Tensor | None = None) -> Figure:
    """The DPO loss of one pair against its log-ratio margin, one curve per beta, each point from ``dpo_loss``."""
    margins = torch.linspace(-10, 10, 201) if margins is None else margins
    no_change = torch.zeros(1)  # the margin sits in the policy's chosen log-probability; the rest is 0
    fig = Figure(figsize=(6.5, 3.6))
    ax = fig.subplots()
    for beta in betas:
        losses = [dpo_loss(margin.view(1), no_change, no_change, no_change, beta)[0].item() for margin in margins]
        ax.plot(margins.tolist(), losses, label=f"β = {beta:g}", gid=f"beta {beta:g}")
    ax.axhline(dpo_loss(no_change, no_change, no_change, no_change, 1.0)[0].item(), color="gray", ls="--", lw=1,
               label="log 2 (margin 0)")
    ax.set(xlabel="log-ratio margin: (log π − log π_ref)(chosen) − (log π − log π_ref)(rejected)",
           ylabel="DPO loss", title="DPO loss = −log σ(β · margin)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig
