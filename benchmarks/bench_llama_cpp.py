"""llama.cpp against the package: the bundled base model exported as GGUF, run by llama.cpp, greedy tokens compared.

    python -m benchmarks.bench_llama_cpp                    # float32 and float16 files, 5 prompts, 40 tokens each
    python -m benchmarks.bench_llama_cpp --new-tokens 100

Needs ``llama-cpp-python`` (``pip install llama-cpp-python``: it builds llama.cpp from source: 10 minutes on
2 cores), which the tests never do. For each prompt (passages of Moby-Dick's held-out last tenth, and two
sentences of its own): llama.cpp's tokenization of the text beside ours, the largest difference between its
logits over the prompt and ours, and the greedy continuation of both, token for token (each feeds back its own
choice). Prints a Markdown section; exits non-zero if a float32 file's tokens differ.
"""

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_threads_flag, machine_description, set_threads, today
from llmscratch.assets import read_moby_dick
from llmscratch.cli import resolve_model
from llmscratch.deployment.gguf import save_gguf
from llmscratch.model.generate import generate
from llmscratch.model.weights import load_model_and_tokenizer
from llmscratch.text.data import split_text

OWN_PROMPTS = ["Call me Ishmael.", "The whale, 1851: ünïcödé and  two  spaces\n\nthen a new paragraph"]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--new-tokens", type=int, default=40, help="greedy tokens generated per prompt (default 40)")
    parser.add_argument("--prompts", type=int, default=3, help="passages of the held-out text used as prompts, "
                                                               "besides two of the benchmark's own (default 3)")
    add_threads_flag(parser)
    args = parser.parse_args()
    set_threads(parser, args.threads)
    return args


def prompts(count: int) -> list[str]:
    held_out = split_text(read_moby_dick(), 0.9)[1]
    starts = np.linspace(0, len(held_out) - 400, count).astype(int)
    return [held_out[s:s + 200] for s in starts] + OWN_PROMPTS


def ours(model, ids: list[int], new_tokens: int) -> tuple[np.ndarray, list[int]]:
    """(logits over the prompt (T, V), greedy continuation) by the package."""
    idx = torch.tensor([ids])
    with torch.no_grad():
        logits = model(idx)[0].float().numpy()
    return logits, generate(model, idx, new_tokens)[0, len(ids):].tolist()


def theirs(llm, ids: list[int], new_tokens: int) -> tuple[np.ndarray, list[int]]:
    """(logits over the prompt (T, V), greedy continuation) by llama.cpp: argmax of its logits, fed back."""
    llm.reset()
    llm.eval(ids)
    logits = np.array(llm.scores[:len(ids)])
    continuation = []
    for _ in range(new_tokens):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        continuation.append(token)
        llm.eval([token])
    return logits, continuation


def main() -> None:
    args = parse_args()
    try:
        from llama_cpp import Llama
    except ImportError:
        sys.exit("error: llama_cpp is not installed; pip install llama-cpp-python (it builds llama.cpp from source)")
    model, tokenizer = load_model_and_tokenizer(resolve_model("base")[1])
    model.eval()
    texts = prompts(args.prompts)
    rows, failed = [], False
    with tempfile.TemporaryDirectory() as folder:
        for dtype in ("float32", "float16"):
            path = Path(folder) / f"base-{dtype}.gguf"
            save_gguf(model, tokenizer, path, dtype=dtype)
            llm = Llama(model_path=str(path), n_ctx=model.config.context_length, logits_all=True, verbose=False,
                        n_threads=args.threads or None)
            for number, text in enumerate(texts):
                ids = tokenizer.encode(text)
                same_ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=False) == ids
                our_logits, our_tokens = ours(model, ids, args.new_tokens)
                their_logits, their_tokens = theirs(llm, ids, args.new_tokens)
                agree = next((i for i, (a, b) in enumerate(zip(our_tokens, their_tokens)) if a != b), len(our_tokens))
                failed |= dtype == "float32" and (agree < len(our_tokens) or not same_ids)
                rows.append(f"| {dtype} | {number + 1} | {len(ids)} | {'yes' if same_ids else 'NO'} | "
                            f"{np.abs(our_logits - their_logits).max():.2e} | {agree}/{len(our_tokens)} |")
            del llm
    print(f"## llama.cpp runs the GGUF export ({today()})\n")
    print(f"The bundled base model, `save_gguf` to llama.cpp's `arcee`, run by llama-cpp-python on {machine_description()}; "
          f"greedy, {args.new_tokens} new tokens per prompt.\n")
    print("| file | prompt | prompt tokens | same tokenization | max abs logit difference (prompt) | "
          "greedy tokens equal |\n|---|---|---|---|---|---|")
    print("\n".join(rows))
    if failed:
        sys.exit("error: llama.cpp's float32 tokens differ from the package's")


if __name__ == "__main__":
    main()
