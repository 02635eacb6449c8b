"""Finetune a pretrained GPT into a spam classifier on the bundled SMS Spam Collection (or --data).

    python ch05-finetuning/finetune_classifier.py              # from the bundled model of ch04's default run
    python ch05-finetuning/finetune_classifier.py --lora --lora-rank 8
    python ch05-finetuning/finetune_classifier.py --base gpt2-folder --test-mode

The run folder (--out-dir) gets metrics.json (test metrics before and after, per-epoch
history), training.png (loss and accuracy per epoch), classifier.pt (load it with
llmscratch.finetuning.classify.Classifier.load, then .classify(text)) and, with LoRA, adapters.safetensors.
"""

import argparse
import sys
import time
from pathlib import Path

import torch

from llmscratch.assets import SMS_SPAM_PATH
from llmscratch.cli import add_out_dir_flags, run_folder, value_errors_exit
from llmscratch.files import write_json_atomically
from llmscratch.finetuning.classify import (SPAM_LABELS, Classifier, GPTClassifier, classification_loss,
                                            evaluate_classifier, make_batches, spam_splits)
from llmscratch.finetuning.config import FinetuneConfig
from llmscratch.finetuning.finetune import (ADAPTERS_FILE, check_trainable, end_of_text_id, fit, fit_and_save,
                                            load_base, set_trainable)
from llmscratch.finetuning.flags import add_finetune_flags, check_finetune_flags, finetune_config
from llmscratch.runfolder import save_or_rescue

DEFAULTS = FinetuneConfig(epochs=3, batch_size=8, lr=5e-4, trainable="all", last_k=2)
MODEL_FILE, METRICS_FILE, PLOT_FILE = "classifier.pt", "metrics.json", "training.png"
OUTPUTS = (MODEL_FILE, ADAPTERS_FILE, METRICS_FILE, PLOT_FILE)  # what a run leaves in --out-dir
EXAMPLE_MESSAGES = ["Hey, are we still meeting for lunch tomorrow?",
                    "WINNER! You have been selected for a 1000 cash prize. Call 09061701461 now to claim."]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_finetune_flags(parser, DEFAULTS)
    parser.add_argument("--data", type=Path, default=SMS_SPAM_PATH,
                        help="the labelled messages: one 'ham<TAB>text' or 'spam<TAB>text' per line "
                             "(default: the bundled SMS Spam Collection)")
    parser.add_argument("--max-length", type=int, default=128,
                        help="tokens kept per message (longer ones are cut; at most the model's context length)")
    add_out_dir_flags(parser, Path("runs/classifier"), holds=", ".join(OUTPUTS))
    parser.add_argument("--test-mode", action="store_true",
                        help="a smoke test in seconds: 32 training messages, 1 epoch, 32 tokens per message")
    args = parser.parse_args(argv)
    check_finetune_flags(parser, args)
    if args.max_length < 1:
        parser.error(f"--max-length must be at least 1, got {args.max_length}")
    return args


def plot(history: list[dict], path: Path) -> None:
    """Training and validation loss, and validation accuracy, per epoch."""
    from matplotlib.figure import Figure  # no pyplot: no global backend

    fig = Figure(figsize=(9, 3.5))
    loss_ax, acc_ax = fig.subplots(1, 2)
    trained = [r for r in history if "train_loss" in r]
    loss_ax.plot([r["epoch"] for r in trained], [r["train_loss"] for r in trained], "o-",
                 label="train (mean over the epoch)")
    loss_ax.plot([r["epoch"] for r in history], [r["val_loss"] for r in history], "o-",
                 label="validation (end of the epoch)")
    loss_ax.set(xlabel="epoch", ylabel="cross-entropy loss", title="loss")
    acc_ax.plot([r["epoch"] for r in history], [r["val_accuracy"] for r in history], "o-", color="C1")
    acc_ax.set(xlabel="epoch", ylabel="accuracy", title="validation accuracy", ylim=(0.0, 1.02))
    for ax in (loss_ax, acc_ax):
        ax.set_xticks([r["epoch"] for r in history])  # epoch 0: before finetuning
        ax.grid(alpha=0.3)
    loss_ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    args = parse_args(argv)
    with value_errors_exit(), run_folder(args, OUTPUTS):  # e.g. a malformed --data file: a message
        status = run(args, finetune_config(args))
    if status:
        sys.exit(status)


def run(args: argparse.Namespace, config: FinetuneConfig) -> int:
    start, device = time.perf_counter(), args.device
    torch.manual_seed(config.seed)
    splits = spam_splits(seed=config.seed, path=args.data)  # a malformed file fails before the model loads
    gpt, tokenizer = load_base(args.base, device, args.tokenizer)
    check_trainable(gpt, config)
    pad_id = end_of_text_id(tokenizer)
    max_length = min(args.max_length, gpt.config.context_length)
    if args.test_mode:  # and one epoch: finetune_config saw to that
        splits = {"train": splits["train"][:32], "validation": splits["validation"][:16], "test": splits["test"][:16]}
        max_length = min(max_length, 32)
    encoded = {name: [(tokenizer.encode(text, disallowed_special=()) or [pad_id], label) for text, label in split]
               for name, split in splits.items()}
    print(f"{args.base}: {gpt.num_params():,} parameters; messages per split: "
          + ", ".join(f"{name} {len(split)}" for name, split in splits.items()) + f"; pad id {pad_id}")

    model = GPTClassifier(gpt, n_classes=len(SPAM_LABELS)).to(device)
    trainable = set_trainable(model.gpt, config, always=[model.head])
    print(f"training {trainable:,} of {sum(p.numel() for p in model.parameters()):,} parameters ({config.trainable})")
    dtype = config.torch_dtype
    batches = {name: make_batches(examples, 2 * config.batch_size, pad_id, max_length)
               for name, examples in encoded.items() if name != "train"}
    before = evaluate_classifier(model, batches["test"], dtype)
    print(f"test accuracy before finetuning: {before['accuracy']:.1%}")

    classifier = Classifier(model, tokenizer, SPAM_LABELS, pad_id, max_length)
    history, stopped = fit_and_save(
        model.gpt, lambda stop: fit(model, lambda epoch: make_batches(encoded["train"], config.batch_size, pad_id,
                                                                  max_length, shuffle_seed=config.seed + epoch),
                                classification_loss, config, device,
                                evaluate=lambda: evaluate_classifier(model, batches["validation"], dtype),
                                progress=not args.no_progress, description="classifier", stop=stop),
        args.out_dir, MODEL_FILE, classifier.save, OUTPUTS)
    metrics = {"test_before": before, "history": history, "trainable_parameters": trainable, "base": str(args.base),
               "max_length": max_length, "pad_id": pad_id, "config": {**vars(config), "lora": vars(config.lora)}}
    if stopped is not None:  # Ctrl-C: the model so far is saved; no test scores
        save_or_rescue(args.out_dir, lambda folder: write_json_atomically(folder / METRICS_FILE, {
            **metrics, "interrupted": str(stopped), "seconds": time.perf_counter() - start}), "the metrics")
        print(f"\ninterrupted: {stopped}; saved the classifier trained so far to {args.out_dir / MODEL_FILE} "
              f"(not scored on the test split)")
        return stopped.exit_status
    after = evaluate_classifier(model, batches["test"], dtype)
    seconds = time.perf_counter() - start

    def save_reports(folder: Path) -> None:
        write_json_atomically(folder / METRICS_FILE, {**metrics, "test": after, "seconds": seconds})
        plot(history, folder / PLOT_FILE)

    save_or_rescue(args.out_dir, save_reports, "the metrics and plot")
    print(f"test accuracy {after['accuracy']:.1%}, precision {after['precision']:.1%}, recall {after['recall']:.1%}, "
          f"F1 {after['f1']:.1%} (before: accuracy {before['accuracy']:.1%}); {seconds:.0f} s in all")
    print(f"confusion matrix (rows: true ham, spam; columns: predicted): {after['confusion']}")
    for message in EXAMPLE_MESSAGES:
        print(f"  {classifier.classify(message):>4}  <- {message!r}")
    print(f"saved {args.out_dir}/: {METRICS_FILE}, {PLOT_FILE}, {MODEL_FILE}")
    return 0


if __name__ == "__main__":
    main()
