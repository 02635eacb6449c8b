"""The record of a training run: one JSON line per step in ``metrics.jsonl``, and ``loss.png``.

Only the main process writes (``enabled=False`` elsewhere). A resumed run first drops the
lines of steps after its checkpoint, since it trains those steps again.
"""

import json
from pathlib import Path

from llmscratch.atomic import write_text_atomically

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


class RunLog:
    """Appends step records to ``out_dir/metrics.jsonl`` and draws them."""

    def __init__(self, out_dir: str | Path, enabled: bool = True):
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / METRICS_FILE
        self.enabled = enabled

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

    def append(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")

    def records(self) -> list[dict]:
        if not self.path.is_file():
            return []
        # A run killed mid-write may leave a partial last line: skip it.
        records = []
        for line in self.path.read_text(encoding="utf-8").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return records

    def plot(self, title: str = "") -> Path | None:
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
        ax.set_title(title)
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = self.out_dir / PLOT_FILE
        fig.savefig(path, dpi=110)
        return path
