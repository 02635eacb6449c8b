"""llmscratch: a large language model built from scratch, one concept per module.

Modules are imported on demand (``from llmscratch.tokenizer import BPETokenizer``) so
that ``import llmscratch`` stays instant.
"""

__version__ = "0.1.0"
