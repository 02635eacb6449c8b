"""Chapter 7, smaller, faster, served: pruning, distillation, speculative decoding and an HTTP server.

``prune``, ``distill``, ``speculative``, ``engine`` (continuous batching), ``server`` (OpenAI's API and a chat
page, ``chat.html``). Quantization, which every model file may hold, is ``llmscratch.model.quantize``.
"""
