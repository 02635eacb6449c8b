"""What a preference-tuning (DPO) or reinforcement-learning (GRPO) run is asked to do: finetuning configs plus
each method's own settings."""

import dataclasses
from dataclasses import dataclass

from llmscratch.config import non_negative, positive, positive_int, setting
from llmscratch.finetuning.config import FinetuneConfig
from llmscratch.training.config import TrainConfig


@dataclass
class DPOConfig(FinetuneConfig):
    """How to tune on preference pairs with DPO (``llmscratch.alignment.preference``): a finetuning run, plus DPO's
    settings."""

    batch_size: int = setting(8, "preference pairs per optimizer step (twice as many rows)", positive_int)
    beta: float = setting(0.1, "DPO's pull towards the starting model: small lets the model drift far from it",
                          positive)
    label_smoothing: float = setting(0.0, "the assumed chance that a pair's preference is wrong (conservative "
                                          "DPO); 0 trusts every pair",
                                     lambda value: None if 0 <= value < 0.5 else "must be in [0, 0.5)")
    sft_weight: float = setting(0.0, "weight of the chosen answers' next-token loss, added to DPO's to keep their "
                                     "likelihood up (RPO); 0: DPO alone", non_negative)


@dataclass
class GRPOConfig(FinetuneConfig):
    """How to tune with reinforcement learning on checked answers (``llmscratch.alignment.grpo``): a finetuning run that
    samples its own training data."""

    steps: int = setting(150, "sampling rounds; each samples a group per prompt, then updates", positive_int)
    prompts_per_step: int = setting(16, "training prompts per sampling round", positive_int)
    group_size: int = setting(8, "answers sampled per prompt: the group its advantages are measured in",
                              lambda value: None if value >= 2 else "must be at least 2")
    updates_per_step: int = setting(1, "optimizer steps on each round's samples (above 1, the clip matters)",
                                    positive_int)
    temperature: float = setting(1.0, "sampling temperature of the rounds", positive)
    clip: float = setting(0.2, "PPO's clip: the ratio to the sampling policy is held within 1 +- clip", positive)
    kl_weight: float = setting(0.0, "weight of the KL penalty to the starting model; 0: none (and no reference "
                                    "model kept)", non_negative)
    format_weight: float = setting(0.0, "reward for an answer of the right form, on top of 1 for a right one; "
                                        "with scaled advantages, wrong answers that differ only in form then get "
                                        "full-size advantages, so 0 by default", non_negative)
    scale_advantages: bool = setting(True, "divide each group's advantages by its reward spread (GRPO); off: "
                                           "Dr. GRPO's centred rewards")
    normalisation: str = setting("sequence", "how token losses are averaged: per answer then over answers, "
                                             "over all tokens, or by a constant", choices=("sequence", "token",
                                                                                           "constant"))
    max_new_tokens: int = setting(24, "longest sampled answer", positive_int)

    def train_config(self, steps_per_epoch: int = 0) -> TrainConfig:
        """The pretraining config whose optimizer and schedule this run reuses: one step per update."""
        return dataclasses.replace(super().train_config(1), max_steps=self.steps * self.updates_per_step,
                                   warmup_steps=int(self.warmup_fraction * self.steps * self.updates_per_step))
