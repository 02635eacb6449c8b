"""Chapter 4, pretraining: the loop, the optimizer, evaluation, checkpoints, and many processes.

``config`` (``TrainConfig``), ``optim`` (AdamW, Muon, the schedule, one step), ``train`` (``Trainer``, the loop),
``evaluation`` (loss, perplexity, bits per byte), ``baselines`` (counting models), ``runlog`` (what a run
leaves behind), ``flops`` (peak FLOP/s, for MFU), ``resume`` (random states and sharded checkpoints),
``distributed`` (ranks and collectives), ``parallel`` (FSDP and tensor parallelism), ``memory`` (the
planner), ``pretraining`` (``pretrain.py``'s flags made into a run: its folder, data, configs and ``Trainer``).
"""
