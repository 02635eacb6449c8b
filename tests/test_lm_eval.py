"""lm-evaluation-harness against serve.py, as a user runs it: its ``local-completions`` model on local task files.

A multiple-choice task (Moby-Dick cloze items, scored by loglikelihood through ``echo`` and ``logprobs``, the
server's own tokenizer reached through vLLM's /tokenize route) must score what the report card's multiple-choice
scoring gives on the same items, and a generation task must run. No download: the tasks' data are written here.
"""

import glob
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from processes import run
from scripts import SCRIPTS
from serving import free_port

from llmscratch.alignment.metrics import score_choices
from llmscratch.alignment.report import choice_scores
from llmscratch.cli import DEFAULT_MODELS
from llmscratch.model.weights import load_model_and_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ITEMS = 20
CLOZE = json.loads((SCRIPTS["serve"].parents[1] / "llmscratch" / "assets" / "moby_cloze.json").read_text())[:ITEMS]

CHOICE_TASK = """task: moby_cloze
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""
GENERATION_TASK = """task: moby_next
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{choices[answer]}}}}"
target_delimiter: " "
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 8
  temperature: 0
metric_list:
  - metric: exact_match
"""


def start_server(port: int) -> subprocess.Popen:
    process = subprocess.Popen([sys.executable, str(SCRIPTS["serve"]), "--port", str(port), "--max-slots", "4"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={k: v for k, v in os.environ.items() if k != "LLMSCRATCH_API_KEYS"})
    deadline = time.monotonic() + 120
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            os.killpg(process.pid, signal.SIGKILL)
            raise AssertionError(f"serve.py did not start: {process.communicate()[0][-4000:]}")
        time.sleep(0.2)


def stop_server(process: subprocess.Popen) -> None:
    os.killpg(process.pid, signal.SIGINT)
    try:
        process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()


def test_lm_eval_scores_multiple_choice_as_the_report_card_does_and_generates(tmp_path):
    data = tmp_path / "moby.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in CLOZE))
    (tmp_path / "moby_cloze.yaml").write_text(CHOICE_TASK.format(data=data))
    (tmp_path / "moby_next.yaml").write_text(GENERATION_TASK.format(data=data))
    port = free_port()
    server = start_server(port)
    try:
        # batch_size 4: prompts go as lists of token-id lists (lm-eval's default tokenized requests)
        model_args = (f"base_url=http://127.0.0.1:{port}/v1/completions,model=base,tokenizer_backend=remote,"
                      f"max_length=256,num_concurrent=1,max_retries=1")
        result = run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
                      "--tasks", "moby_cloze,moby_next", "--include_path", str(tmp_path), "--batch_size", "4",
                      "--output_path", str(tmp_path / "out"), "--log_samples"], timeout=400,
                     env={**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "unused",
                          "TOKENIZERS_PARALLELISM": "false"})
    finally:
        stop_server(server)
    assert result.returncode == 0, result.stderr[-6000:]
    found = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    results = json.loads(Path(found[0]).read_text())
    scores = results["results"]
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODELS["base"][0])
    with torch.inference_mode():
        expected = choice_scores(model.float().eval(), tokenizer, CLOZE, "cloze")["cloze_accuracy"]
    hits = round(scores["moby_cloze"]["acc,none"] * ITEMS)
    assert abs(hits - round(expected["value"] * ITEMS)) <= 1, (scores["moby_cloze"], expected)
    # Item by item: the harness's loglikelihood of each choice is the package's (it encodes context and choice
    # together, the package apart: where a tokenization differs, so may a score, hence "all but one item").
    samples = [json.loads(line) for path in glob.glob(str(tmp_path / "out" / "**" / "samples_moby_cloze_*.jsonl"),
                                                      recursive=True) for line in Path(path).read_text().splitlines()]
    assert len(samples) == ITEMS
    agree = 0
    for sample in samples:
        item = CLOZE[sample["doc_id"]]
        ours = score_choices(model, tokenizer, item["context"], item["choices"], " ").logprobs
        theirs = [float(response[0]) for response in sample["filtered_resps"]]  # the log writes them as text
        agree += theirs == pytest.approx(ours, abs=1e-3)
    assert agree >= ITEMS - 1
    assert "exact_match,none" in scores["moby_next"] and results["n-samples"]["moby_next"]["effective"] == ITEMS
