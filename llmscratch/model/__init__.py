"""Chapters 2 and 3, the model: attention and its parts, the GPT they make, generation, and model files.

Chapter 2: ``attention`` (causal, multi-head and grouped-query attention, the KV cache), ``rope``.
Chapter 3: ``config`` (``GPTConfig`` and the presets), ``norm``, ``mlp``, ``moe``, ``gpt`` (the block and
the model), ``generate`` (decoding, with ``decode_kernels``), ``checkpoint`` (our model files),
``hf_formats`` and ``weights`` (Hugging Face checkpoints, and ``load_model_and_tokenizer`` for any source),
``figures``. ``losses`` (the chunked cross-entropy the model's forward computes) is built in chapter 4, and
``quantize`` (int8 and int4 layers, which any model file may hold) in chapter 7.
"""
