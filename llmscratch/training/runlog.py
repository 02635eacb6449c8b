"""What a training run shows and leaves behind: its progress bar, ``metrics.jsonl``, ``loss.png``,
``summary.json`` and ``sample.txt``.

Only the main process writes (``enabled=False`` elsewhere). A resumed run first drops the
lines of steps after its checkpoint, since it trains those steps again.
"""

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from llmscratch.device import autocast
from llmscratch.files import parse_json_lines, write_text_atomically
from llmscratch.model.generate import generate
from llmscratch.progress import progress_bar
from llmscratch.training.config import TrainConfig

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"
SUMMARY_FILE = "summary.json"
SAMPLE_FILE = "sample.txt"


def sample_text(model, tokenizer, config: TrainConfig, device: torch.device) -> str:
    """A continuation of ``config.sample_prompt`` from its own seeded generator: the run's random state is untouched."""
    prompt = tokenizer.encode(config.sample_prompt, allowed_special="all")
    prompt = prompt[-model.config.context_length:] or [tokenizer.eot_token or 0]
    idx = torch.tensor([prompt], device=device)  # (1, T)
    generator = torch.Generator(device).manual_seed(config.seed)
    fits = len(prompt) + config.sample_tokens - 1 <= model.config.context_length
    with autocast(device, config.torch_dtype):
        out = generate(model, idx, config.sample_tokens, temperature=config.sample_temperature,
                       top_k=config.sample_top_k, use_cache=fits, generator=generator)  # (1, T + n)
    # Ids past the tokenizer's vocabulary (rows that pad the embedding to a round size) decode to nothing.
    return tokenizer.decode([i for i in out[0].tolist() if i < tokenizer.vocab_size])


class RunLog:
    """Appends step records to ``out_dir/metrics.jsonl``, draws them, and shows them on a progress bar.

    title: the plot's title (e.g. the model's size and the tokens per step).
    """

    def __init__(self, out_dir: str | Path, enabled: bool = True, title: str = ""):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / METRICS_FILE
        self.enabled = enabled
        self.title = title
        self.bar = None
        self.speed: dict = {}  # the last tokens/s (and MFU) measured: the bar shows it until the next one

    def start(self) -> None:
        """Begin a fresh run: forget the records of any earlier one."""
        if self.enabled:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self.path.unlink(missing_ok=True)

    def truncate(self, step: int) -> None:
        """Keep only the records up to ``step`` (the step a resumed run restarts from)."""
        if self.enabled and self.path.is_file():
            kept = [record for record in self.records() if record["step"] <= step]
            # Atomically: a crash now must not lose the records of the steps that are kept.
            write_text_atomically(self.path, "".join(json.dumps(r) + "\n" for r in kept))

    @contextlib.contextmanager
    def progress(self, enabled: bool, total: int, initial: int = 0) -> Iterator[None]:
        """Show the records appended inside the block on a progress bar of ``total`` steps."""
        with progress_bar(self.enabled and enabled, total, "pretraining", "step", initial) as self.bar:
            try:
                yield
            finally:
                self.bar = None

    def append(self, record: dict) -> None:
        """Add a step's record to metrics.jsonl; redraw loss.png after an evaluation; show it on the bar."""
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if "val_loss" in record:
            self.plot()
        if self.bar is not None:
            self._show(record)

    def _show(self, record: dict) -> None:
        if "tokens_per_s" in record:
            self.speed = {k: record[k] for k in ("tokens_per_s", "mfu") if k in record}
        shown = {"loss": f"{record['loss']:.3f}", "lr": f"{record['lr']:.2e}"}
        if "tokens_per_s" in self.speed:
            shown["tok/s"] = f"{self.speed['tokens_per_s']:,.0f}"
        if "mfu" in self.speed:
            shown["mfu"] = f"{100 * self.speed['mfu']:.1f}%"
        self.bar.set_postfix(shown, refresh=False)
        self.bar.update(1)
        if "val_loss" in record:
            self.bar.write(f"step {record['step']}: val loss {record['val_loss']:.3f}, "
                           f"bits/byte {record['val_bits_per_byte']:.3f}")
        if "sample" in record:
            self.bar.write(f"sample: {record['sample']!r}")

    def records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        # A run killed mid-write may leave a partial last line: skipped.
        return parse_json_lines(self.path.read_text(encoding="utf-8"), self.path, skip_malformed=True)

    def plot(self) -> Path | None:
        """loss.png: training loss per step and validation loss at each evaluation."""
        if not self.enabled:
            return None
        from matplotlib.figure import Figure  # no pyplot: no global backend, safe in notebooks and threads

        records = self.records()
        fig = Figure(figsize=(7, 4))
        ax = fig.subplots()
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], lw=0.8, alpha=0.6, label="train")
        val = [r for r in records if "val_loss" in r]
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats per token)")
        ax.set_title(self.title)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = self.out_dir / PLOT_FILE
        fig.savefig(path, dpi=110)
        return path

    def finish(self, summary: dict) -> None:
        """Write summary.json and, when the run has a sample, sample.txt (each atomically)."""
        if not self.enabled:
            return
        write_text_atomically(self.out_dir / SUMMARY_FILE, json.dumps(summary, indent=2) + "\n")
        if summary.get("sample") is not None:
            write_text_atomically(self.out_dir / SAMPLE_FILE, summary["sample"] + "\n")
