"""Chapter 1, text to tokens: byte-pair encoding, the tokenizers, and the data a model learns from.

``bpe`` (the merge algorithms on lists of ids), ``tokenizer`` (``BPETokenizer``, GPT-2's rebuilt exactly),
``special_tokens`` (the rules every tokenizer shares), ``checks`` (what a tokenizer is made from, checked where
it enters), ``sentencepiece`` (Gemma's BPE with byte fallback),
``hf_tokenizer`` (Hugging Face's tokenizer.json, and ``load_tokenizer`` for any tokenizer file), ``hf_export``
(ours written as a Hugging Face tokenizer folder),
``chat_template`` (a Hugging Face model's chat format), ``corpus`` (text and token files), ``data`` (windows
of token ids to train on, and the held-out tenth of Moby-Dick), ``figures`` (the chapter's diagrams).
"""
