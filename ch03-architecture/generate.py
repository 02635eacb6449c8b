"""Continue a prompt with a GPT: one of our training checkpoints or a Hugging Face folder.

    python ch03-architecture/generate.py runs/pretrain/checkpoint.pt --prompt "Call me"
    python ch03-architecture/generate.py path/to/gpt2 --prompt "Hello," --temperature 0 --max-new-tokens 40

The text streams to the terminal as it is generated. Our checkpoints (the ``model.safetensors``
export or the ``checkpoint.pt`` that ch04-pretraining/pretrain.py writes, or the run folder holding
them) carry their tokenizer; a Hugging Face folder (``config.json`` + ``model.safetensors``) uses its
``tokenizer.json`` (Qwen2/Qwen3, Llama 3, GPT-2, Gemma: ``llmscratch.text.hf_tokenizer``), and one of the GPT-2
family without it GPT-2's vocabulary, which ships with llmscratch. Other vocabularies: pass ``--tokenizer`` (a JSON
file saved by chapter 1's script). Past the model's context each new token reads only the last context's
worth of tokens (a sliding window, the whole window run per token), so --max-new-tokens is bounded to
64 contexts.
"""

import argparse
import sys
from pathlib import Path

import torch

from llmscratch.cli import check_device, run_script
from llmscratch.device import DTYPES
from llmscratch.model.generate import stream_text
from llmscratch.model.quantize import describe
from llmscratch.model.weights import load_model_and_tokenizer  # every model source the course writes, one loader

MAX_WINDOWS = 64  # --max-new-tokens at most this many contexts: past one, every token reruns a whole window


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, with the model loaded (``args.loaded``: model and tokenizer) to check them against."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("checkpoint", type=Path,
        help="our model.safetensors export or checkpoint.pt (or the run folder holding them), or a "
             "Hugging Face folder")
    add("--prompt", default="",
        help="the text to continue (default: empty, which starts from the <|endoftext|> token)")
    add("--max-new-tokens", type=int, default=100,
        help=f"how many tokens to generate at most, up to {MAX_WINDOWS} times the model's context (default 100)")
    add("--temperature", type=float, default=0.8,
        help="divides the logits before sampling: < 1 safer, > 1 wilder; 0 is greedy decoding (default 0.8)")
    add("--top-k", type=int, default=None, help="sample only among the k most likely tokens (default: all)")
    add("--top-p", type=float, default=0.95,
        help="sample only among the most likely tokens whose probabilities add up to p; 1 keeps all (default 0.95)")
    add("--seed", type=int, default=0, help="random seed of the sampler: the same seed gives the same text (default 0)")
    add("--eos-id", type=int, default=None,
        help="stop when this token is generated (default: the tokenizer's <|endoftext|>, if it has one)")
    add("--ignore-eos", action="store_true", help="never stop early: always generate --max-new-tokens tokens")
    add("--tokenizer", type=Path, default=None,
        help="a tokenizer JSON file to use instead of the checkpoint's own (or of GPT-2's for a Hugging Face folder)")
    add("--dtype", choices=sorted(DTYPES), default="float32",
        help="precision of the weights and the computation (default float32; bfloat16 halves the memory)")
    add("--device", default="auto", help="'cpu', 'cuda', 'cuda:1', 'mps', ... (default: cuda if available, else cpu)")
    add("--compile", action="store_true",
        help="compile the decoding step with torch.compile: the same text, faster per token once compiled "
             "(the first step waits for the compiler, tens of seconds on a CPU)")
    args = parser.parse_args(argv)
    if not args.checkpoint.exists():
        parser.error(f"checkpoint {args.checkpoint}: no such file or folder")
    if args.tokenizer is not None and not args.tokenizer.is_file():
        parser.error(f"--tokenizer {args.tokenizer}: no such file")
    if args.max_new_tokens < 0:
        parser.error(f"--max-new-tokens must be >= 0, got {args.max_new_tokens}")
    if not args.temperature >= 0:
        parser.error(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        parser.error(f"--top-k must be at least 1, got {args.top_k}")
    if not 0 < args.top_p <= 1:
        parser.error(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.ignore_eos and args.eos_id is not None:
        parser.error("--eos-id and --ignore-eos contradict each other: give one of them")
    check_device(parser, args)
    try:
        args.loaded = load_model_and_tokenizer(args.checkpoint, args.tokenizer)
    except ValueError as err:
        sys.exit(f"error: {err}")
    context = args.loaded[0].config.context_length
    if args.max_new_tokens > MAX_WINDOWS * context:
        parser.error(f"--max-new-tokens {args.max_new_tokens:,} is more than {MAX_WINDOWS} times the model's context "
                     f"of {context:,} tokens ({MAX_WINDOWS * context:,}): past its context each new token reads "
                     f"only the last {context:,}, and reruns them all; ask for at most {MAX_WINDOWS * context:,}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    model, tokenizer = args.loaded
    if quantization := getattr(model, "quantization", None):  # --dtype applies to the rest: norms, embedding, scales
        print(f"note: {args.checkpoint} holds {describe(quantization)}; --dtype {args.dtype} is the precision of "
              f"the rest", file=sys.stderr)
    model = model.to(device=args.device, dtype=DTYPES[args.dtype]).eval()
    eos_id = None if args.ignore_eos else (tokenizer.eot_token if args.eos_id is None else args.eos_id)
    prompt = args.prompt
    if not prompt:
        if tokenizer.eot_token is None:
            sys.exit("error: an empty --prompt starts from <|endoftext|>, which this tokenizer lacks; give a prompt")
        prompt = tokenizer.decode([tokenizer.eot_token])
    else:
        print(prompt, end="", flush=True)
    n_prompt, context = len(tokenizer.encode(prompt, allowed_special="all")), model.config.context_length
    if n_prompt > context:
        print(f"\nnote: the prompt is {n_prompt:,} tokens, more than the model's context of {context:,}: it reads only "
              f"the last {context:,} of them", file=sys.stderr)
    elif n_prompt + args.max_new_tokens > context:
        print(f"\nnote: {n_prompt:,} prompt tokens and {args.max_new_tokens:,} new ones are more than the model's "
              f"context of {context:,}: past it each new token reads only the last {context:,} (a sliding window, "
              f"slower)", file=sys.stderr)
    generator = torch.Generator(device=args.device).manual_seed(args.seed)
    try:
        for piece in stream_text(model, tokenizer, prompt, args.max_new_tokens, temperature=args.temperature,
                                 top_k=args.top_k, top_p=args.top_p, eos_id=eos_id, generator=generator,
                                 compile=args.compile):
            print(piece, end="", flush=True)
    except ValueError as err:  # e.g. an --eos-id outside the vocabulary
        print(file=sys.stderr)
        sys.exit(f"error: {err}")
    except KeyboardInterrupt:  # Ctrl-C stops the stream; what was printed stays
        print()
        sys.exit(130)
    print()


if __name__ == "__main__":
    run_script(main)
