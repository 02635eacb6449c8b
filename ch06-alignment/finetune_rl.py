"""Tune the chapter-5 instruction model with reinforcement learning on checked answers (GRPO), and score it.

    python ch06-alignment/finetune_rl.py                  # from runs/instructions/model.safetensors
    python ch06-alignment/finetune_rl.py --kl-weight 0.05 --updates-per-step 2
    python ch06-alignment/finetune_rl.py --model some/model.safetensors --test-mode

Each round samples --group-size answers to each of --prompts-per-step training prompts (drawn
afresh from the task families, none of them a held-out prompt; or the train split of --instructions),
rewards each answer with its family's checker (1 if right, plus
--format-weight if written in the family's form and ended), and updates the model towards the
answers above their group's mean (llmscratch.alignment.grpo). Then it scores the starting model and the tuned
one on the test split: exact match and well-formed answers (greedy, as chapter 5 scores them),
pass@k for k = 1 .. --pass-samples (sampled at temperature 1) and bits per byte on the held-out
tenth of Moby-Dick. If --model is the default and absent, chapter 5's script trains it first. The
run folder (--out-dir) gets metrics.json, rl.png (reward over the rounds; pass@k before and after),
comparison.md, answers.jsonl and model.safetensors (LoRA merged; with LoRA, adapters.safetensors too).
"""

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import torch

from llmscratch.alignment.config import GRPOConfig
from llmscratch.alignment.grpo import pass_at_k_scores, pass_at_k_table, plot_rl, train_grpo
from llmscratch.alignment.report import held_out_scores
from llmscratch.alignment.tasks import draw_prompts
from llmscratch.assets import INSTRUCTIONS_PATH
from llmscratch.cli import (HelpFormatter, add_flags, add_out_dir_flags, check_device, check_in_files, check_out_dir,
                            refuse, run_folder, value_errors_exit)
from llmscratch.files import write_json_atomically, write_text_atomically
from llmscratch.finetuning.finetune import (ADAPTERS_FILE, check_trainable, end_of_text_id, fit_and_save, load_base,
                                            set_trainable)
from llmscratch.finetuning.flags import add_lora_flags, finetune_config, starting_model
from llmscratch.finetuning.instruct import (answers_jsonl, comparison_table, encode_records, read_instruction_splits,
                                            score_answers)
from llmscratch.model.checkpoint import export_model
from llmscratch.runfolder import save_or_rescue
from llmscratch.text.data import held_out_moby_dick

DEFAULT_MODEL = Path("runs/instructions/model.safetensors")
DEFAULTS = GRPOConfig(lr=1e-4, warmup_fraction=0.05, trainable="all")  # 5e-5 and 3e-4 did worse (RESULTS.md)
MODEL_FILE, METRICS_FILE, TABLE_FILE, ANSWERS_FILE, PLOT_FILE = (
    "model.safetensors", "metrics.json", "comparison.md", "answers.jsonl", "rl.png")
OUTPUTS = (MODEL_FILE, ADAPTERS_FILE, METRICS_FILE, TABLE_FILE, ANSWERS_FILE, PLOT_FILE)  # what a run leaves
PROMPTS_PER_FAMILY = 400  # drawn prompts (fewer where a family has fewer)
TEST_MODE = {"steps": 2, "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 8}


# --------------------------------------------------------------------------- flags
def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="the instruction model to start from (a model.safetensors of ch05-finetuning/"
                             "finetune_instructions.py, or any model --base of that script takes); the default, "
                             "if absent, is trained first by that script")
    parser.add_argument("--instructions", type=Path, default=INSTRUCTIONS_PATH,
                        help="the instruction records: the train split's prompts are the RL prompts, the test "
                             "split's are scored (as ch05's --data)")
    parser.add_argument("--prompts", choices=("drawn", "train"), default="drawn",
                        help="where the RL prompts come from: drawn afresh from the 13 task families (never a "
                             "validation or test prompt of --instructions), or the train split of --instructions")
    add_flags(parser, DEFAULTS, "steps", "prompts_per_step", "group_size", "updates_per_step", "temperature", "clip",
              "kl_weight", "format_weight", "scale_advantages", "normalisation", "max_new_tokens")
    add_lora_flags(parser, DEFAULTS, "shorthand for --trainable lora (the adapters alone; with --kl-weight the "
                                     "reference is the model with its adapters off)")
    add_flags(parser, DEFAULTS, "lr", "warmup_fraction", "dtype", "seed")
    parser.add_argument("--pass-samples", type=int, default=16,
                        help="answers sampled per test prompt to measure pass@k for k = 1 .. this, before and "
                             "after; 0 skips it")
    parser.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps")
    add_out_dir_flags(parser, Path("runs/rl"), holds=", ".join(OUTPUTS))
    parser.add_argument("--test-mode", action="store_true",
                        help="a smoke test in seconds: 2 rounds of 2 prompts x 2 answers of at most 8 tokens, "
                             "13 test prompts, pass@k from 2 samples")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    check_flags(parser, args)
    return args


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """parser.error (exit status 2, naming the flag) for a flag that cannot work; resolves --device."""
    if not args.model.exists() and args.model != DEFAULT_MODEL:  # only the default is trained when missing
        parser.error(f"--model {args.model}: no such file or folder (expected a model.safetensors of "
                     "ch05-finetuning/finetune_instructions.py)")
    check_in_files(parser, {"--instructions": args.instructions})
    if args.pass_samples < 0:
        parser.error(f"--pass-samples must be 0 (skip) or more, got {args.pass_samples}")
    check_out_dir(parser, args.out_dir, starting_model=("--model", args.model))
    check_device(parser, args)
    if args.test_mode:
        for name, value in TEST_MODE.items():
            setattr(args, name, min(getattr(args, name), value))
        args.pass_samples = min(args.pass_samples, 2)
    try:
        rl_config(args)  # made again by run(): refused here, before any work
    except ValueError as err:
        refuse(parser, err)


def rl_config(args: argparse.Namespace) -> GRPOConfig:
    return dataclasses.replace(finetune_config(args, GRPOConfig), epochs=1)


# --------------------------------------------------------------------------- main
def main(argv=None) -> None:
    args = parse_args(argv)
    with value_errors_exit(), run_folder(args, OUTPUTS):  # e.g. a malformed --instructions record: a message
        status = run(args, rl_config(args))
    if status:
        sys.exit(status)


def scores_of(model, tokenizer, records, encoded, args, config: GRPOConfig, progress: bool) -> tuple[dict, list]:
    """Exact match and well-formed answers (greedy), pass@k (sampled) and held-out bits per byte."""
    scores, answers = score_answers(model, tokenizer, records, encoded, end_of_text_id(tokenizer),
                                    config.max_new_tokens, config.torch_dtype, progress)
    if args.pass_samples:
        scores["pass_at_k"] = pass_at_k_scores(model, tokenizer, records, args.pass_samples, config.max_new_tokens,
                                               seed=config.seed, dtype=config.torch_dtype)
    windows = 2 if args.test_mode else None
    novel = held_out_scores(model, tokenizer, held_out_moby_dick(), args.device, max_windows=windows)
    scores["bits_per_byte"] = novel["bits_per_byte"]["value"]
    scores["uniform_bits_per_byte"] = novel["uniform_bits_per_byte"]["value"]
    return scores, answers


def training_prompts(args: argparse.Namespace, splits: dict[str, list[dict]], seed: int) -> list[dict]:
    """The RL prompts: --prompts drawn (PROMPTS_PER_FAMILY of each family, none held out) or train."""
    if args.prompts == "train":
        return splits["train"]
    per_family = 2 if args.test_mode else PROMPTS_PER_FAMILY
    return draw_prompts(per_family, seed, exclude=splits["validation"] + splits["test"])


def run(args: argparse.Namespace, config: GRPOConfig) -> int:
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    splits = read_instruction_splits(args.instructions, args.test_mode)
    prompts = training_prompts(args, splits, config.seed)
    model_path = starting_model(args.model, DEFAULT_MODEL, args)
    model, tokenizer = load_base(model_path, args.device)
    check_trainable(model, config)
    try:
        encoded = encode_records(splits["test"], tokenizer, model.config.context_length)
    except ValueError as err:
        raise ValueError(f"{args.instructions}, 'test' split: {err}") from None
    print(f"{model_path}: {model.num_params():,} parameters; {len(prompts)} training prompts ({args.prompts}), "
          f"{len(splits['test'])} test prompts")

    progress = not args.no_progress
    start_scores, start_answers = scores_of(model, tokenizer, splits["test"], encoded, args, config, progress)
    trainable = set_trainable(model, config)
    print(f"instruction model: exact match {start_scores['exact_match']:.1%}, well-formed "
          f"{start_scores['well_formed']:.1%}, {start_scores['bits_per_byte']:.3f} bits per byte; "
          f"training {trainable:,} parameters ({config.trainable})")

    history, stopped = fit_and_save(
        model, lambda stop: train_grpo(model, tokenizer, prompts, config, args.device, progress, stop),
        args.out_dir, MODEL_FILE, lambda path: export_model(model, path, tokenizer), OUTPUTS)
    metrics = {"instruction_model": start_scores, "history": history, "trainable_parameters": trainable,
               "starting_model": str(model_path), "data": str(args.instructions),
               "config": {**vars(config), "lora": vars(config.lora)}, "training_seconds":
               sum(record["seconds"] for record in history)}
    if stopped is not None:  # Ctrl-C: the model so far is saved; it is not scored
        save_or_rescue(args.out_dir, lambda folder: write_json_atomically(folder / METRICS_FILE, {
            **metrics, "interrupted": str(stopped), "seconds": time.perf_counter() - start}), "the metrics")
        print(f"\ninterrupted: {stopped}; saved the model trained so far to {args.out_dir / MODEL_FILE} (not scored)")
        return stopped.exit_status
    scores, answers = scores_of(model, tokenizer, splits["test"], encoded, args, config, progress)
    seconds = time.perf_counter() - start
    results = {"instruction model": start_scores, "RL": scores}
    table = comparison_table(results)
    if args.pass_samples:
        table += "\n\n" + pass_at_k_table(results)

    def save_reports(folder: Path) -> None:
        plot_rl(history, {name: r.get("pass_at_k") for name, r in results.items()}, folder / PLOT_FILE)
        write_text_atomically(folder / TABLE_FILE, table + "\n")
        write_text_atomically(folder / ANSWERS_FILE, answers_jsonl(splits["test"], {"instruction_model": start_answers,
                                                                                    "rl": answers}))
        write_json_atomically(folder / METRICS_FILE, {**metrics, "rl": scores, "seconds": seconds})

    save_or_rescue(args.out_dir, save_reports, "the scores, answers and plot")
    print(table)
    print(f"{seconds:.0f} s in all ({metrics['training_seconds']:.0f} s training); saved {args.out_dir}/: "
          f"{METRICS_FILE}, {PLOT_FILE}, {TABLE_FILE}, {ANSWERS_FILE}, {MODEL_FILE}")
    return 0


if __name__ == "__main__":
    main()
