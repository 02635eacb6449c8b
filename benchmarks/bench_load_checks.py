"""What checking weights at load costs (issue 27): our loaders, which refuse damaged or wrong weights, beside
the plain loaders that check nothing.

    python -m benchmarks.bench_load_checks --threads 1     # from the repository root; prints a Markdown section

Each loader reads the same file, interleaved (``round_robin``), medians reported. A training checkpoint
(``load_checkpoint``: every zip entry's CRC-32, then the weights floating point and finite) beside
``torch.load(weights_only=True)``; a model export (``read_safetensors``: the sha256 written with its tensors
and metadata; then ``check_weights``) beside ``safetensors.torch.load_file``. The files are written once,
in a temporary folder, from random weights of the named shapes.
"""

import argparse
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks.common import add_threads_flag, load_average, machine_description, median, set_threads, today
from llmscratch.files import check_weights, read_safetensors
from llmscratch.model.checkpoint import export_model, load_checkpoint, save_checkpoint
from llmscratch.model.config import GPTConfig
from llmscratch.model.gpt import GPT
from llmscratch.profiling import round_robin, time_once


def checkpoint_file(folder: Path, preset: str, **overrides) -> Path:
    """A checkpoint.pt of the preset's random weights and an AdamW state of the same size (a training state)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.from_preset(preset, **overrides))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long), targets=torch.zeros(1, 8, dtype=torch.long)).backward()
    optimizer.step()  # its moments exist now
    path = folder / f"{preset}.pt"
    save_checkpoint(path, {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                           "model_config": model.config.to_dict(), "step": 1})
    return path


def export_file(folder: Path, preset: str) -> Path:
    torch.manual_seed(0)
    path = folder / f"{preset}.safetensors"
    export_model(GPT(GPTConfig.from_preset(preset)), path)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="interleaved rounds; medians are reported")
    add_threads_flag(parser)
    args = parser.parse_args(argv)
    set_threads(parser, args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        checkpoint = checkpoint_file(folder, "llama-small", n_layers=5)
        times = round_robin({"ours": lambda: time_once(lambda: load_checkpoint(checkpoint)),
                             "plain": lambda: time_once(lambda: torch.load(checkpoint, weights_only=True))},
                            args.rounds, "checkpoint.pt")
        rows.append((f"checkpoint.pt, llama-small with 5 blocks, AdamW state ({checkpoint.stat().st_size / 1e6:.0f} MB)",
                     "`load_checkpoint`", "`torch.load(weights_only=True)`", times))
        export = export_file(folder, "gpt2-small")

        def ours_export() -> float:
            return time_once(lambda: check_weights(read_safetensors(export)[1], export))

        times = round_robin({"ours": ours_export, "plain": lambda: time_once(lambda: load_file(export))},
                            args.rounds, "model.safetensors")
        rows.append((f"model.safetensors, gpt2-small, float32 ({export.stat().st_size / 1e6:.0f} MB)",
                     "`read_safetensors` + `check_weights`", "`safetensors.torch.load_file`", times))

    print(f"### Run of {today()}\n")
    print(f"Command: `python -m benchmarks.bench_load_checks{f' --threads {args.threads}' if args.threads else ''}`  ")
    print(f"Machine: {machine_description()}; load average before: {load_average()}  ")
    print(f"Median of {args.rounds} interleaved rounds, each loader reading the same file (warm in the page cache).\n")
    print("| file | checked loader | s | plain loader | s | checks cost |")
    print("|---|---|---:|---|---:|---:|")
    for file, ours, plain, times in rows:
        ours_s, plain_s = median(times["ours"]), median(times["plain"])
        print(f"| {file} | {ours} | {ours_s:.3f} | {plain} | {plain_s:.3f} | +{ours_s - plain_s:.3f} s "
              f"({ours_s / plain_s:.2f}x) |")
    print("\nThe plain safetensors loader maps the file and reads no tensor bytes until they are used; the checked\n"
          "one reads them all once (sha256, then finiteness): its cost is that one pass over the file.")


if __name__ == "__main__":
    main()
