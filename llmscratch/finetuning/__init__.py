"""Chapter 5, finetuning: a spam classifier, an instruction follower, and LoRA.

``config`` (``FinetuneConfig``, ``LoRAConfig``), ``finetune`` (what both tasks share: the base model, what
trains, the loop), ``classify``, ``instruct``, ``lora``, ``flags`` (the finetuning scripts' shared flags),
``figures``.
"""
