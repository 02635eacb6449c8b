"""Tune the chapter-5 instruction model on preference pairs with DPO, and score it against where it started.

    python ch06-alignment/finetune_preferences.py              # from runs/instructions/model.safetensors
    python ch06-alignment/finetune_preferences.py --lora --beta 0.5
    python ch06-alignment/finetune_preferences.py --style full-stop --sft-weight 1 --out-dir runs/preferences-style
    python ch06-alignment/finetune_preferences.py --model some/model.safetensors --test-mode

Trains on the train split of the preference pairs (--data, a JSON list of records with
instruction, input, chosen, rejected, split and optionally family; or, with --style, pairs made
from the instruction records that prefer a style of answer), the starting model being
the frozen reference (with --lora: the same model, adapters off). Then it scores both models:
preference accuracy (the share of held-out pairs whose chosen answer gets the higher implicit
reward) on the test pairs, and exact match and well-formed answers on the test split of the
instruction data, scored as ch05-finetuning/finetune_instructions.py scores. If --model is the
default and absent, that script trains it first. The run folder (--out-dir) gets metrics.json,
dpo.png (loss, reward margin and held-out accuracy), comparison.md, answers.jsonl and
model.safetensors (LoRA merged; with LoRA, adapters.safetensors too).
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from llmscratch.alignment.config import DPOConfig
from llmscratch.alignment.dpo import pair_batches, plot_dpo, preference_scores, preference_table, read_pairs, train_dpo
from llmscratch.alignment.preference import ReferenceModel
from llmscratch.alignment.tasks import STYLES, style_pairs
from llmscratch.assets import INSTRUCTIONS_PATH, PREFERENCES_PATH
from llmscratch.cli import (HelpFormatter, add_flags, add_out_dir_flags, check_device, check_in_files, check_out_dir,
                            refuse, run_folder, value_errors_exit)
from llmscratch.files import write_json_atomically, write_text_atomically
from llmscratch.finetuning.finetune import (ADAPTERS_FILE, check_trainable, end_of_text_id, fit_and_save, load_base,
                                            set_trainable)
from llmscratch.finetuning.flags import add_lora_flags, finetune_config, starting_model
from llmscratch.finetuning.instruct import (MAX_NEW_TOKENS, answers_jsonl, comparison_table, encode_records,
                                            read_instruction_splits, read_json_records, score_answers, split_records)
from llmscratch.model.checkpoint import export_model
from llmscratch.runfolder import save_or_rescue

DEFAULT_MODEL = Path("runs/instructions/model.safetensors")
DEFAULTS = DPOConfig(epochs=2, batch_size=8, lr=2e-5, beta=0.1, trainable="all")
MODEL_FILE, METRICS_FILE, TABLE_FILE, ANSWERS_FILE, PLOT_FILE = (
    "model.safetensors", "metrics.json", "comparison.md", "answers.jsonl", "dpo.png")
OUTPUTS = (MODEL_FILE, ADAPTERS_FILE, METRICS_FILE, TABLE_FILE, ANSWERS_FILE, PLOT_FILE)  # what a run leaves


# --------------------------------------------------------------------------- flags
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="the instruction model to start from (a model.safetensors of ch05-finetuning/"
                             "finetune_instructions.py, or any model --base of that script takes); the default, "
                             "if absent, is trained first by that script (about 15 minutes on a laptop CPU)")
    parser.add_argument("--data", type=Path, default=PREFERENCES_PATH,
                        help="a JSON list of preference records (instruction, input, chosen, rejected, split; "
                             "family optional)")
    parser.add_argument("--style", choices=sorted(STYLES),
                        help="instead of --data, pairs that teach a style and no skill: for each instruction record, "
                             "its right answer in the style (full-stop: ending with '.') chosen over the same answer "
                             "without it")
    parser.add_argument("--instructions", type=Path, default=INSTRUCTIONS_PATH,
                        help="the instruction records whose test split is answered to score exact match and "
                             "well-formed answers (as ch05's --data)")
    add_flags(parser, DEFAULTS, "beta", "label_smoothing", "sft_weight")
    add_lora_flags(parser, DEFAULTS, "shorthand for --trainable lora (here the adapters alone: the head stays as it "
                                     "was, so the model with its adapters off is exactly the reference)")
    add_flags(parser, DEFAULTS, "epochs", "lr", "batch_size", "warmup_fraction", "dtype", "seed")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                        help="longest answer generated per test prompt (as ch05's script)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps")
    add_out_dir_flags(parser, Path("runs/preferences"), holds=", ".join(OUTPUTS))
    parser.add_argument("--test-mode", action="store_true",
                        help="a smoke test in seconds: 2 training pairs per family, 1 epoch, 13 held-out pairs "
                             "and 13 test prompts, answers of at most 8 tokens")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    check_flags(parser, args)
    return args


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error (exit status 2, naming the flag) for a flag that cannot work; resolves --device."""
    if not args.model.exists() and args.model != DEFAULT_MODEL:  # only the default is trained when missing
        parser.error(f"--model {args.model}: no such file or folder (expected a model.safetensors of "
                     "ch05-finetuning/finetune_instructions.py)")
    check_in_files(parser, {"--data": args.data, "--instructions": args.instructions})
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    check_out_dir(parser, args.out_dir, starting_model=("--model", args.model))
    check_device(parser, args)
    try:
        finetune_config(args, DPOConfig)  # made again by run(): refused here, before any work
    except ValueError as err:
        refuse(parser, err)
    if args.test_mode:
        args.max_new_tokens = min(args.max_new_tokens, 8)


# --------------------------------------------------------------------------- main
def main(argv=None) -> None:
    args = parse_args(argv)
    with value_errors_exit(), run_folder(args, OUTPUTS):  # e.g. a malformed --data record: a message
        status = run(args, finetune_config(args, DPOConfig))
    if status:
        sys.exit(status)


def run(args: argparse.Namespace, config: DPOConfig) -> int:
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    pair_splits = (read_pairs(args.data, args.test_mode) if args.style is None else
                   split_records(style_pairs(read_json_records(args.instructions), args.style), args.instructions,
                                 args.test_mode))
    instructions = read_instruction_splits(args.instructions, args.test_mode)["test"]
    model_path = starting_model(args.model, DEFAULT_MODEL, args)
    model, tokenizer = load_base(model_path, args.device)
    check_trainable(model, config)
    eos_id, context, dtype = end_of_text_id(tokenizer), model.config.context_length, config.torch_dtype
    try:
        encoded = encode_records(instructions, tokenizer, context)
    except ValueError as err:
        raise ValueError(f"{args.instructions}, 'test' split: {err}") from None
    print(f"{model_path}: {model.num_params():,} parameters; pairs per split: "
          + ", ".join(f"{name} {len(split)}" for name, split in pair_splits.items())
          + f"; {len(instructions)} instruction test prompts")

    progress = not args.no_progress
    start_scores, start_answers = score_answers(model, tokenizer, instructions, encoded, eos_id, args.max_new_tokens,
                                                dtype, progress)
    # LoRA: adapters only, so that the policy with its adapters off is exactly the starting model.
    trainable = set_trainable(model, config, always=[] if config.trainable == "lora" else [model.lm_head])
    batches = pair_batches(pair_splits, tokenizer, ReferenceModel(model), config, context)
    start_pairs = preference_scores(model, batches["test"], config)
    print(f"instruction model: exact match {start_scores['exact_match']:.1%}, well-formed "
          f"{start_scores['well_formed']:.1%}, likelihood accuracy {start_pairs['likelihood_accuracy']:.1%}; "
          f"training {trainable:,} parameters ({config.trainable})")

    steps: list[dict] = []
    history, stopped = fit_and_save(
        model, lambda stop: train_dpo(model, batches, config, args.device, progress, steps, stop), args.out_dir,
        MODEL_FILE, lambda path: export_model(model, path, tokenizer), OUTPUTS)
    metrics = {"instruction_model": {**start_scores, "pairs": start_pairs}, "history": history, "steps": steps,
               "trainable_parameters": trainable, "starting_model": str(model_path), "data": str(args.data) if args.style is None else f"style:{args.style}",
               "pairs_per_split": {name: len(split) for name, split in pair_splits.items()},
               "config": {**vars(config), "lora": vars(config.lora)}}
    if stopped is not None:  # Ctrl-C: the model so far is saved; it is not scored
        save_or_rescue(args.out_dir, lambda folder: write_json_atomically(folder / METRICS_FILE, {
            **metrics, "interrupted": str(stopped), "seconds": time.perf_counter() - start}), "the metrics")
        print(f"\ninterrupted: {stopped}; saved the model trained so far to {args.out_dir / MODEL_FILE} (not scored)")
        return stopped.exit_status
    pairs = preference_scores(model, batches["test"], config)
    scores, answers = score_answers(model, tokenizer, instructions, encoded, eos_id, args.max_new_tokens, dtype,
                                    progress)
    seconds = time.perf_counter() - start
    table = (comparison_table({"instruction model": start_scores, "DPO": scores}) + "\n\n"
             + preference_table({"instruction model": start_pairs, "DPO": pairs}))

    def save_reports(folder: Path) -> None:
        plot_dpo(steps, history, len(batches["train"]), pairs["accuracy"], folder / PLOT_FILE)
        write_text_atomically(folder / TABLE_FILE, table + "\n")
        write_text_atomically(folder / ANSWERS_FILE, answers_jsonl(instructions, {"instruction_model": start_answers,
                                                                                  "dpo": answers}))
        write_json_atomically(folder / METRICS_FILE, {**metrics, "dpo": {**scores, "pairs": pairs}, "seconds": seconds})

    save_or_rescue(args.out_dir, save_reports, "the scores, answers and plot")
    print(table)
    print(f"{seconds:.0f} s in all; saved {args.out_dir}/: {METRICS_FILE}, {PLOT_FILE}, {TABLE_FILE}, {ANSWERS_FILE}, "
          f"{MODEL_FILE}")
    return 0


if __name__ == "__main__":
    main()
