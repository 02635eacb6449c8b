"""Chapters 2 and 3, the model: attention and its parts, the GPT they make, generation, and model files.

Chapter 2: ``attention`` (causal, multi-head and grouped-query attention, the KV cache), ``rope``, ``checks``
(the arguments of attention, RoPE and generation, checked at their doors). Chapter 3: ``config`` (``GPTConfig``
and the presets), ``norm``, ``mlp``, ``moe``, ``gpt`` (the block and the model), ``generate`` (decoding, with
``decode_kernels``), ``hf_formats`` and ``weights`` (Hugging Face checkpoints, and ``load_model_and_tokenizer``
for any source), ``figures``. Built later but part of every model: ``losses`` (the chunked cross-entropy the
model's forward computes) and ``checkpoint`` (our model files), in chapter 4; ``quantize`` (int8 and int4
layers, which any model file may hold), in chapter 7.
"""
