"""The chapter scripts, run whole as programs: argv in, exit status and output out.

Tests reach the logic through the package; a script is only ever run as ``python SCRIPT ARGV...`` would run it.
``run_script`` does that in this process (no start-up cost, and a test may patch what the script leans on, such as
``os.replace``); a test that needs a process of its own starts ``[sys.executable, SCRIPTS[name], ...]``.
"""

import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = {"pretrain": ROOT / "ch04-pretraining" / "pretrain.py",
           "generate": ROOT / "ch03-architecture" / "generate.py",
           "classifier": ROOT / "ch05-finetuning" / "finetune_classifier.py",
           "instructions": ROOT / "ch05-finetuning" / "finetune_instructions.py",
           "instructions_data": ROOT / "ch05-finetuning" / "make_instruction_data.py",
           "preferences": ROOT / "ch06-alignment" / "finetune_preferences.py",
           "preferences_data": ROOT / "ch06-alignment" / "make_preference_data.py",
           "evaluate": ROOT / "ch06-alignment" / "evaluate.py",
           "cloze": ROOT / "ch06-alignment" / "make_cloze_data.py",
           "tokenizer": ROOT / "ch01-tokenization" / "train_tokenizer.py",
           "serve": ROOT / "ch07-deployment" / "serve.py",
           "quantize": ROOT / "ch07-deployment" / "quantize.py",
           "export": ROOT / "ch07-deployment" / "export.py"}


def run_script(name: str, argv: list[str]) -> int | str:
    """Run the script ``name`` (a key of SCRIPTS) with ``argv`` as its command line, in this process.

    Returns its exit status: 0, an int, or the text a ``sys.exit("error: ...")`` gave (status 1). Other exceptions
    (KeyboardInterrupt, a test's injected fault) come through as they would end the program.
    """
    path = SCRIPTS[name]
    saved = sys.argv
    sys.argv = [str(path), *map(str, argv)]
    try:
        runpy.run_path(str(path), run_name="__main__")
    except SystemExit as exit_info:
        return 0 if exit_info.code is None else exit_info.code
    finally:
        sys.argv = saved
    return 0
