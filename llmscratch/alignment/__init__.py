"""Chapter 6, alignment and evaluation: preference tuning (DPO), reinforcement learning (GRPO), and the scores.

``config`` (``DPOConfig``, ``GRPOConfig``), ``preference`` (pairs, sequence log-probabilities, the DPO loss),
``dpo`` (the DPO run), ``tasks`` (the instruction task families and their checkers), ``grpo``, ``metrics``
(ROUGE-L, BLEU, multiple choice), ``cloze``, ``report`` (the report card), ``figures``.
"""
