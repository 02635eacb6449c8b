"""llmscratch: a large language model built from scratch, one chapter at a time.

The package follows the book's stages, one subpackage each, a lower stage never importing a higher one:
``text`` (chapter 1), ``model`` (chapters 2 and 3), ``training`` (4), ``finetuning`` (5), ``alignment`` (6),
``deployment`` (7); ``exercises`` checks the chapters' exercises. The modules at the top are the small tools
every stage shares: ``files``, ``config``, ``cli``, ``device``, ``interrupt``, ``progress``, ``runfolder``,
``native``, ``profiling``, ``drawing``, and the bundled data in ``assets``.

Modules are imported on demand (``from llmscratch.text.tokenizer import BPETokenizer``) so that
``import llmscratch`` stays instant.
"""

__version__ = "0.1.0"
