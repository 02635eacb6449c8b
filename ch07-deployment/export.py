"""Export a model for other runners: a Hugging Face folder (transformers, vLLM) or a GGUF file (llama.cpp, Ollama).

    python ch07-deployment/export.py --out runs/export/base
    python ch07-deployment/export.py --model instructions --out runs/export/instructions
    python ch07-deployment/export.py --format gguf --out runs/export/base.gguf
    vllm serve runs/export/base        # or AutoModelForCausalLM.from_pretrained("runs/export/base")

--model is base (the bundled model), instructions or dpo (the default places of ch05's and ch06's runs), a run
folder or a model file. --format hf writes config.json and model.safetensors (llmscratch.model.weights.save_hf:
the squared-ReLU Llama the course trains is transformers' Arcee; a quantized model is written dequantized, in
float32) with the tokenizer's tokenizer.json, tokenizer_config.json and generation_config.json; the instruction
models' tokenizer_config.json carries ch05's prompt format as a chat template. A shape no Hugging Face family
holds is refused by name before anything is written. An --out folder holding anything but an earlier export is
refused; an earlier export is replaced only once the new one is whole. --format gguf writes one file
(llmscratch.deployment.gguf) for the Llama-shaped models.
"""

import argparse
import os
import shutil
from pathlib import Path

from llmscratch.cli import check_out_files, resolve_model, run_script, value_errors_exit
from llmscratch.deployment.gguf import gguf_architecture, save_gguf
from llmscratch.finetuning.instruct import CHAT_TEMPLATE
from llmscratch.model.hf_formats import family_of
from llmscratch.model.quantize import describe
from llmscratch.model.weights import load_model_and_tokenizer, save_hf
from llmscratch.text.hf_export import save_tokenizer_hf

# The files of an export: an --out folder holding only these (and config.json) is an earlier export, replaced
EXPORT_FILES = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", "special_tokens_map.json", "chat_template.jinja"}
INSTRUCTION_MODELS = ("instructions", "dpo", "dpo-style", "rl")  # --model names of ch05's and ch06's runs


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, with the model loaded (``args.loaded``: model and tokenizer)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="base", metavar="MODEL",
        help="base, instructions, dpo, a run folder or a model file (default: base, the bundled model)")
    add("--out", type=Path, required=True,
        help="hf: the folder to write (new, empty, or an earlier export, which is replaced); gguf: a .gguf file")
    add("--format", choices=("hf", "gguf"), default="hf",
        help="hf: a Hugging Face folder (transformers, vLLM); gguf: one file for llama.cpp and Ollama (default hf)")
    add("--chat-template", choices=("auto", "course", "none"), default="auto",
        help="hf only: course puts ch05's instruction format in tokenizer_config.json as the chat template; auto: "
             f"course for the models named {', '.join(INSTRUCTION_MODELS)}, none for the others (default auto)")
    args = parser.parse_args(argv)
    try:
        name, args.model = resolve_model(args.model)
    except ValueError as err:
        parser.error(str(err))
    args.chat = args.chat_template == "course" or (args.chat_template == "auto" and name in INSTRUCTION_MODELS)
    check_out(parser, args)
    with value_errors_exit():
        args.loaded = load_model_and_tokenizer(args.model)
    try:  # a shape with no home in the format, named before anything is written
        (gguf_architecture if args.format == "gguf" else family_of)(args.loaded[0].config)
    except ValueError as err:
        parser.error(f"--model {args.model}: {err}")
    return args


def check_out(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error for an --out the format cannot be written to, or a folder that holds more than an export."""
    out = args.out
    if args.format == "gguf":
        if out.suffix != ".gguf":
            parser.error(f"--out {out}: expected a .gguf file name with --format gguf")
        check_out_files(parser, {"--out": out}, {"--model": args.model})
        return
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out} is a file; --format hf writes a folder (give a new or empty folder's path)")
    found = {path.name for path in out.iterdir()} if out.is_dir() else set()
    strangers = sorted(found - EXPORT_FILES)
    if strangers or (found and "config.json" not in found):
        shown = ", ".join(strangers[:5]) if strangers else ", ".join(sorted(found))
        parser.error(f"--out {out} holds files that are not those of an earlier export ({shown}); give a new or "
                     f"empty folder, or an earlier export to replace")


def write_folder(out: Path, write) -> None:
    """``write(folder)`` into a new folder beside ``out``, then that folder put in ``out``'s place: an earlier
    export is replaced only by a whole one, and a failure leaves ``out`` as it was."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging, old = (out.with_name(f".{out.name}.{kind}-{os.getpid()}") for kind in ("partial", "old"))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        write(staging)
        if out.exists():
            out.rename(old)
        staging.rename(out)
    except BaseException:
        if old.exists() and not out.exists():
            old.rename(out)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


def main(argv=None) -> None:
    args = parse_args(argv)
    model, tokenizer = args.loaded
    model.eval()
    quantization = getattr(model, "quantization", None)

    def write_hf(folder: Path) -> None:
        save_hf(model, folder)
        save_tokenizer_hf(tokenizer, folder, chat_template=CHAT_TEMPLATE if args.chat else None,
                          model_max_length=model.config.context_length)

    with value_errors_exit():
        if args.format == "gguf":
            args.out.parent.mkdir(parents=True, exist_ok=True)
            save_gguf(model, tokenizer, args.out)
        else:
            write_folder(args.out, write_hf)
    if quantization is not None and args.format == "hf":
        print(f"the model's {describe(quantization)} are written dequantized, as float32: Hugging Face's "
              f"formats hold float weights")
    template = "with ch05's chat template" if args.chat and args.format == "hf" else ""
    print(f"wrote {args.out} {template}".rstrip())


if __name__ == "__main__":
    run_script(main)
