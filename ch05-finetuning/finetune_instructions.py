"""Finetune a pretrained GPT to follow instructions, and score it against the base model.

    python ch05-finetuning/finetune_instructions.py            # from the bundled model of ch04's default run
    python ch05-finetuning/finetune_instructions.py --lora --lora-rank 8
    python ch05-finetuning/finetune_instructions.py --base gpt2-folder --test-mode

Trains on the bundled instruction set (or --data, a JSON list of records with instruction,
input, output, split and optionally family), then answers the test prompts with the base model
and the finetuned one. The run folder (--out-dir) gets metrics.json, comparison.md (exact
match per family, well-formed answers, held-out response loss), answers.jsonl,
model.safetensors (the finetuned model, LoRA merged, which --base and
llmscratch.model.checkpoint.model_from_checkpoint accept) and, with LoRA, adapters.safetensors.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from llmscratch.assets import INSTRUCTIONS_PATH
from llmscratch.cli import add_out_dir_flags, run_folder, value_errors_exit
from llmscratch.files import write_json_atomically, write_text_atomically
from llmscratch.finetuning.config import FinetuneConfig
from llmscratch.finetuning.finetune import (ADAPTERS_FILE, check_trainable, end_of_text_id, fit, fit_and_save,
                                            load_base, set_trainable)
from llmscratch.finetuning.flags import add_finetune_flags, check_finetune_flags, finetune_config
from llmscratch.finetuning.instruct import (MAX_NEW_TOKENS, Replay, answers_jsonl, comparison_table, encode_records,
                                            lm_loss_with_replay, make_batches, read_instruction_splits, response_loss,
                                            score_answers)
from llmscratch.model.checkpoint import export_model
from llmscratch.runfolder import save_or_rescue
from llmscratch.text.data import held_out_moby_dick, moby_dick_training_text
from llmscratch.training.evaluation import held_out_bits

DEFAULTS = FinetuneConfig(epochs=8, batch_size=8, lr=1e-3, trainable="all")
REPLAY_WINDOWS, REPLAY_LENGTH = 2, 128  # pretraining windows per batch, and their tokens: the best trade-off
# of exact match against forgetting measured (benchmarks/RESULTS.md, "Forgetting")
MODEL_FILE, METRICS_FILE = "model.safetensors", "metrics.json"
TABLE_FILE, ANSWERS_FILE = "comparison.md", "answers.jsonl"
OUTPUTS = (MODEL_FILE, ADAPTERS_FILE, METRICS_FILE, TABLE_FILE, ANSWERS_FILE)  # what a run leaves in --out-dir


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_finetune_flags(parser, DEFAULTS)
    parser.add_argument("--data", type=Path, default=INSTRUCTIONS_PATH,
                        help="a JSON list of records (instruction, input, output, split; family optional)")
    parser.add_argument("--train-on-prompt", action="store_true",
                        help="learn the prompt tokens too (default: mask them, so only the response is learned)")
    parser.add_argument("--max-new-tokens", type=int, default=MAX_NEW_TOKENS,
                        help="longest answer generated per test prompt")
    parser.add_argument("--replay", type=int, default=REPLAY_WINDOWS, metavar="WINDOWS",
                        help="windows of the pretraining text (the first 90%% of Moby-Dick, which the bundled model "
                             "learned) mixed into each batch, each learned like the base learned it, so that "
                             "finetuning does not erase the language model; 0: none")
    parser.add_argument("--replay-length", type=int, default=REPLAY_LENGTH,
                        help="tokens per replayed window; a model with a shorter context replays windows of its "
                             "context length")
    add_out_dir_flags(parser, Path("runs/instructions"), holds=", ".join(OUTPUTS))
    parser.add_argument("--test-mode", action="store_true",
                        help="a smoke test in seconds: 2 training records per family, 1 epoch, "
                             "1 test record per family")
    args = parser.parse_args(argv)
    check_finetune_flags(parser, args)
    if args.max_new_tokens < 1:
        parser.error(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.replay < 0 or args.replay_length < 1:
        parser.error(f"--replay must be 0 or more and --replay-length at least 1, got {args.replay} and "
                     f"{args.replay_length}")
    if args.test_mode:
        args.max_new_tokens = min(args.max_new_tokens, 8)
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    with value_errors_exit(), run_folder(args, OUTPUTS):  # e.g. a malformed --data record: a message
        status = run(args, finetune_config(args))
    if status:
        sys.exit(status)


def replay_of(args: argparse.Namespace, tokenizer, context_length: int, seed: int) -> Replay | None:
    """The pretraining windows to replay (--replay), or None; a window is at most the model's context."""
    if not args.replay:
        return None
    length = min(args.replay_length, context_length)
    if length < args.replay_length:
        print(f"replaying windows of {length} tokens, the model's context length (--replay-length {args.replay_length})")
    tokens = tokenizer.encode(moby_dick_training_text(), disallowed_special=())
    return Replay(tokens, args.replay, length, seed)


def run(args: argparse.Namespace, config: FinetuneConfig) -> int:
    start = time.perf_counter()
    torch.manual_seed(config.seed)
    splits = read_instruction_splits(args.data, args.test_mode)
    model, tokenizer = load_base(args.base, args.device, args.tokenizer)
    check_trainable(model, config)
    eos_id = end_of_text_id(tokenizer)
    max_length = model.config.context_length
    encoded = {}
    for name, split in splits.items():  # every record must fit whole: no answer is cut, no row dropped
        try:
            encoded[name] = encode_records(split, tokenizer, max_length)
        except ValueError as err:
            raise ValueError(f"{args.data}, {name!r} split: {err}") from None
    print(f"{args.base}: {model.num_params():,} parameters; records per split: "
          + ", ".join(f"{name} {len(split)}" for name, split in splits.items()))
    dtype = config.torch_dtype

    progress = not args.no_progress
    windows = 2 if args.test_mode else None  # of the held-out novel

    def novel_bits_per_byte() -> float:  # what the model still knows of the text it was pretrained on
        return held_out_bits(model, tokenizer, held_out_moby_dick(), args.device, max_windows=windows)["bits_per_byte"]

    base_scores, base_answers = score_answers(model, tokenizer, splits["test"], encoded["test"], eos_id,
                                              args.max_new_tokens, dtype, progress)  # before any change
    base_scores["bits_per_byte"] = novel_bits_per_byte()
    print(f"base model: exact match {base_scores['exact_match']:.1%}, response loss "
          f"{base_scores['response_loss']:.3f}, {base_scores['bits_per_byte']:.3f} bits per byte on the held-out novel")

    trainable = set_trainable(model, config, always=[] if config.trainable == "lora" else [model.lm_head])
    print(f"training {trainable:,} parameters ({config.trainable})")
    mask_prompt = not args.train_on_prompt
    validation = encoded["validation"]
    replay = replay_of(args, tokenizer, max_length, config.seed)

    def batches(epoch: int) -> list:
        tasks = make_batches(encoded["train"], config.batch_size, eos_id, mask_prompt, max_length,
                             shuffle_seed=config.seed + epoch)
        return [(task, replay.batch() if replay else None) for task in tasks]

    history, stopped = fit_and_save(
        model, lambda stop: fit(model, batches, lm_loss_with_replay, config, args.device,
                                evaluate=lambda: {"bits_per_byte": novel_bits_per_byte(), **({"response_loss": (
                                    response_loss(model, validation, eos_id, max_length=max_length, dtype=dtype))}
                                    if validation else {})},
                                progress=progress, description="instructions", stop=stop),
        args.out_dir, MODEL_FILE, lambda path: export_model(model, path, tokenizer), OUTPUTS)
    metrics = {"base": base_scores, "history": history, "trainable_parameters": trainable, "mask_prompt": mask_prompt,
               "replay": {"windows": args.replay, "length": replay.length if replay else None},
               "base_model": str(args.base), "config": {**vars(config), "lora": vars(config.lora)}}
    if stopped is not None:  # Ctrl-C: the model so far is saved; its answers are not scored
        save_or_rescue(args.out_dir, lambda folder: write_json_atomically(folder / METRICS_FILE, {
            **metrics, "interrupted": str(stopped), "seconds": time.perf_counter() - start}), "the metrics")
        print(f"\ninterrupted: {stopped}; saved the model trained so far to {args.out_dir / MODEL_FILE} "
              f"(its answers not scored)")
        return stopped.exit_status
    scores, answers = score_answers(model, tokenizer, splits["test"], encoded["test"], eos_id, args.max_new_tokens,
                                    dtype, progress)
    scores["bits_per_byte"] = novel_bits_per_byte()
    seconds = time.perf_counter() - start
    table = comparison_table({"base": base_scores, "finetuned": scores})

    def save_reports(folder: Path) -> None:
        write_text_atomically(folder / TABLE_FILE, table + "\n")
        write_text_atomically(folder / ANSWERS_FILE, answers_jsonl(splits["test"], {"base": base_answers,
                                                                                    "finetuned": answers}))
        write_json_atomically(folder / METRICS_FILE, {**metrics, "finetuned": scores, "seconds": seconds})

    save_or_rescue(args.out_dir, save_reports, "the scores and answers")
    print(table)
    print(f"{seconds:.0f} s in all; saved {args.out_dir}/: {METRICS_FILE}, {TABLE_FILE}, {ANSWERS_FILE}, {MODEL_FILE}")
    return 0


if __name__ == "__main__":
    main()
