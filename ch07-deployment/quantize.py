"""Store a model's weights as int8 or int4 (weight-only quantization), and say what it cost.

    python ch07-deployment/quantize.py --scheme int8 --out runs/quantized/int8.safetensors
    python ch07-deployment/quantize.py --model instructions --scheme int4 --group-size 64 \\
        --out runs/quantized/instructions-int4.safetensors

--model is base (the bundled model), instructions or dpo (the default places of ch05's and
ch06's runs), a run folder or a model file: a float model (an already quantized one is refused by
name; a mixture of experts has its experts quantized too). The quantized model is written as a model export
(safetensors, its integers and scales as they are, with the tokenizer) that every script's
--model or checkpoint argument takes. Then the held-out tenth of Moby-Dick is scored in bits per
byte by the model before and after, and the file sizes are compared (llmscratch.model.quantize).
"""

import argparse
from pathlib import Path

import torch

from llmscratch.alignment.report import Benchmarks, language_model_scores
from llmscratch.cli import check_out_files, resolve_model, run_script, value_errors_exit
from llmscratch.model.checkpoint import export_model
from llmscratch.model.quantize import SCHEMES, describe, group_sizes, quantizable_layers, quantize
from llmscratch.model.weights import load_model_and_tokenizer
from llmscratch.text.data import held_out_moby_dick

DEFAULT_GROUP_SIZE = 64  # int4's inputs per scale unless --group-size says


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, with the model loaded (``args.loaded``: model and tokenizer) to check them against."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="base", metavar="MODEL",
        help="base, instructions, dpo, a run folder or a model file (default: base, the bundled model)")
    add("--scheme", choices=sorted(SCHEMES), default="int8",
        help="int8: one scale per output row; int4: one scale per group of inputs, two values a byte (default int8)")
    add("--group-size", type=int, default=None,
        help=f"int4 only: inputs sharing a scale; an even number that divides every layer's input size "
             f"(default {DEFAULT_GROUP_SIZE})")
    add("--keep-head", action="store_true",
        help="leave the output head in floating point (by default it is stored as int8 under either scheme)")
    add("--out", type=Path, required=True, help="the .safetensors file to write (replaced if it exists)")
    add("--test-mode", action="store_true", help="a smoke test in seconds: score 2 windows of held-out text, not all")
    args = parser.parse_args(argv)
    try:
        _, args.model = resolve_model(args.model)
    except ValueError as err:
        parser.error(str(err))
    if args.out.suffix != ".safetensors":
        parser.error(f"--out {args.out}: expected a .safetensors file name (a model export)")
    check_out_files(parser, {"--out": args.out}, {"--model": args.model})
    with value_errors_exit():
        args.loaded = load_model_and_tokenizer(args.model)
    check_model(parser, args, args.loaded[0])
    return args


def check_model(parser: argparse.ArgumentParser, args: argparse.Namespace, model) -> None:
    """parser.error for a model ``quantize`` cannot take, or a --group-size that does not fit it."""
    try:
        quantizable_layers(model)
    except ValueError as err:
        parser.error(f"--model {args.model}: {err}")
    if args.scheme != "int4":
        if args.group_size is not None:
            parser.error("--group-size applies to --scheme int4 only (int8 has one scale per output row); "
                         "drop it, or give --scheme int4")
        return
    sizes = group_sizes(model)
    given = args.group_size is not None
    args.group_size = args.group_size if given else DEFAULT_GROUP_SIZE
    if args.group_size not in sizes:
        flag = "--group-size" if given else "the default --group-size"
        parser.error(f"{flag} {args.group_size} does not fit {args.model}: int4 groups must be an even number "
                     f"dividing every quantized layer's input size; choose one of {', '.join(map(str, sizes))}")


def size_mb(path: Path) -> float:
    return path.stat().st_size / 1e6


def main(argv=None) -> None:
    args = parse_args(argv)
    model, tokenizer = args.loaded
    model = model.float().eval()
    quantized = quantize(model, args.scheme, args.group_size or DEFAULT_GROUP_SIZE, head=not args.keep_head)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    export_model(quantized, args.out, tokenizer)
    print(f"wrote {args.out} ({size_mb(args.out):.1f} MB; {describe(quantized.quantization, quantized)})")
    texts = Benchmarks(held_out=held_out_moby_dick(), max_windows=2 if args.test_mode else None)
    for label, m in (("before", model), ("after", quantized)):
        with torch.no_grad():
            bits = language_model_scores(m, tokenizer, texts, torch.device("cpu"))["bits_per_byte"]["value"]
        print(f"held-out bits per byte {label}: {bits:.4f}")


if __name__ == "__main__":
    run_script(main)
