"""Chapter 7, smaller, faster, served: pruning, distillation, speculative decoding and an HTTP server.

``prune``, ``distill``, ``speculative``, ``engine`` (continuous batching), ``server`` (OpenAI's API and a chat
page, ``chat.html``), ``guard`` (the server's door: keys, limits, body caps, deadlines; its uvicorn server),
``gguf`` (a model and its tokenizer as one GGUF file, for llama.cpp and Ollama). Quantization, which every model
file may hold, is ``llmscratch.model.quantize``.
"""
