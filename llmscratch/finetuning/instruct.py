"""Instruction finetuning: Alpaca-style prompts, a masking collate function, answers and their scores.

A record is ``{"instruction": ..., "input": ..., "output": ...}`` (input may be empty). The
model learns to continue the prompt with the output and then ``<|endoftext|>``; at inference
it answers until it emits that token. Answers are scored without an external judge: exact
match per task family, the share of well-formed answers, and the loss on held-out answers.
"""

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from llmscratch.device import autocast
from llmscratch.files import JSON_ERRORS, parse_json_lines
from llmscratch.model.generate import generate, with_bos
from llmscratch.model.gpt import evaluating
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.model.weights import load_model_and_tokenizer
from llmscratch.progress import progress_bar
from llmscratch.text.corpus import read_text_file

HEADER = "Below is an instruction that describes a task. Write a response that appropriately completes the request."
FIELDS = ("instruction", "input", "output")
TEMPLATE_MARKERS = ("###", HEADER[:24])  # text of the template that has no place in an answer
MAX_NEW_TOKENS = 24  # per answer where a model is scored (ch05-finetuning/finetune_instructions.py's default)


# --------------------------------------------------------------------------- records
SPLITS = ("train", "validation", "test")
# Records per split that a chapter script keeps in --test-mode (spread evenly over each split).
TEST_MODE_SIZES = {"train": 26, "validation": 13, "test": 13}


def validate_records(records) -> list[dict]:
    """The records, checked: ValueError naming the index and field of the first bad one.

    instruction, input and output must be strings; instruction and output must not be blank
    (an empty output would teach the model to stop at once). family and split, if present,
    must be strings too.
    """
    if not isinstance(records, list):
        raise ValueError(f"instruction data must be a list of records, got {type(records).__name__}")
    for index, record in enumerate(records):
        if not isinstance(record, dict):
            raise ValueError(f"record {index} is a {type(record).__name__}, expected an object with fields {FIELDS}")
        for name in (*FIELDS, "family", "split"):
            if name not in record:
                if name in FIELDS:
                    raise ValueError(f"record {index}: field {name!r} is missing")
                continue
            if not isinstance(record[name], str):
                raise ValueError(f"record {index}: field {name!r} must be a string, "
                                 f"got {type(record[name]).__name__} {record[name]!r}")
        for name in ("instruction", "output"):
            if not record[name].strip():
                raise ValueError(f"record {index}: field {name!r} is empty")
    return records


def format_prompt(record: dict) -> str:
    """The Alpaca-style prompt: header, instruction, the input if any, and the response marker."""
    prompt = f"{HEADER}\n\n### Instruction:\n{record['instruction']}"
    if record.get("input"):
        prompt += f"\n\n### Input:\n{record['input']}"
    return prompt + "\n\n### Response:\n"


def format_chat(messages: Sequence[dict]) -> str:
    """A conversation in the same template, ending where the model's next answer starts.

    messages: OpenAI-style ``{"role": "system" | "user" | "assistant", "content": str}``, the last one
    the user's. A system message replaces the header; each user turn is an instruction and each
    assistant turn its response, so a one-turn chat is exactly ``format_prompt`` of that instruction.
    The models were finetuned on one turn: later turns ask of them what they never practised.
    """
    header = HEADER
    turns = []
    for index, message in enumerate(messages):
        role, content = message["role"], message["content"]
        if role == "system":
            if index:
                raise ValueError(f"message {index}: a system message can only come first")
            header = content
        elif role == "user":
            turns.append(f"### Instruction:\n{content}\n\n### Response:\n")
        elif role == "assistant":
            if not turns or not turns[-1].endswith("### Response:\n"):
                raise ValueError(f"message {index}: an assistant message must answer a user message")
            turns[-1] += f"{content}\n\n"
        else:
            raise ValueError(f"message {index}: role {role!r} is not one of system, user, assistant")
    if not turns or not turns[-1].endswith("### Response:\n"):
        raise ValueError("the last message must be the user's (there is nothing to answer)")
    return f"{header}\n\n" + "".join(turns)


# ``format_chat`` as a Jinja chat template, for an exported model's tokenizer_config.json: transformers'
# apply_chat_template(messages, add_generation_prompt=True) renders what format_chat returns, character for
# character, and raises (raise_exception) where it raises. The prompt always ends where the answer starts, so
# add_generation_prompt changes nothing. (tests/test_tokenizer_export.py holds the two to each other.)
CHAT_TEMPLATE = r"""{%- set ns = namespace(header='HEADER', turns='', open=false) -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}
        {%- if not loop.first -%}
            {{- raise_exception('message ' ~ loop.index0 ~ ': a system message can only come first') -}}
        {%- endif -%}
        {%- set ns.header = message['content'] -%}
    {%- elif message['role'] == 'user' -%}
        {%- set ns.turns = ns.turns ~ '### Instruction:\n' ~ message['content'] ~ '\n\n### Response:\n' -%}
        {%- set ns.open = true -%}
    {%- elif message['role'] == 'assistant' -%}
        {%- if not ns.open -%}
            {{- raise_exception('message ' ~ loop.index0 ~ ': an assistant message must answer a user message') -}}
        {%- endif -%}
        {%- set ns.turns = ns.turns ~ message['content'] ~ '\n\n' -%}
        {%- set ns.open = false -%}
    {%- else -%}
        {{- raise_exception('message ' ~ loop.index0 ~ ": role '" ~ message['role'] ~ "' is not one of system, "
                            ~ 'user, assistant') -}}
    {%- endif -%}
{%- endfor -%}
{%- if not ns.open -%}
    {{- raise_exception("the last message must be the user's (there is nothing to answer)") -}}
{%- endif -%}
{{- ns.header ~ '\n\n' ~ ns.turns -}}""".replace("HEADER", HEADER)


def encode_records(records: Sequence[dict], tokenizer,
                   context_length: int | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids) per record, encoded apart: the prompt's ids are those seen at inference
    (after the tokenizer's BOS, where it has one: Llama 3's, Gemma's).

    With ``context_length``, every record must fit whole in one training row: prompt + output
    + <|endoftext|> in context_length + 1 tokens (a row's inputs and targets are that, shifted by
    one). ValueError naming each record that does not, rather than cutting its answer or its
    end-of-text token, or masking all of its targets.
    """
    records = validate_records(list(records))
    encoded = [(with_bos(tokenizer, tokenizer.encode(format_prompt(r), disallowed_special=())),
                tokenizer.encode(r["output"], disallowed_special=())) for r in records]
    if context_length is not None:
        too_long = [(index, len(prompt), len(output)) for index, (prompt, output) in enumerate(encoded)
                    if len(prompt) + len(output) > context_length]
        if too_long:
            shown = "; ".join(f"record {index} ({records[index]['instruction'][:40]!r}): prompt {prompt} + output "
                              f"{output} + 1 tokens" for index, prompt, output in too_long[:5])
            more = f" and {len(too_long) - 5} more" if len(too_long) > 5 else ""
            raise ValueError(f"{len(too_long)} record(s) do not fit the model's context_length={context_length} "
                             f"(at most {context_length + 1} tokens with <|endoftext|>): {shown}{more}; "
                             "shorten their inputs or use a model with a longer context")
    return encoded


# --------------------------------------------------------------------------- batches
def collate(examples: Sequence[tuple[Sequence[int], Sequence[int]]], eos_id: int, pad_id: int | None = None,
            mask_prompt: bool = False, max_length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (B, T) for next-token training on prompt + output + <|endoftext|>.

    Each row is shifted by one (targets[t] = sequence[t + 1]); rows are padded on the right to
    the longest in the batch, inputs with pad_id (default eos_id), targets with IGNORE_INDEX,
    so the one end-of-text target that matters stays. mask_prompt also sets the targets inside
    the prompt to IGNORE_INDEX: only the output is learned. Rows are cut to max_length tokens;
    a row left with no target to learn is a ValueError (``encode_records`` checks records whole).
    """
    if not examples:
        raise ValueError("collate needs at least one example")
    pad_id = eos_id if pad_id is None else pad_id
    rows = []
    for prompt, output in examples:
        sequence = [*prompt, *output, eos_id]
        targets = sequence[1:]
        if mask_prompt:  # targets[t] is sequence[t + 1]: the first len(prompt) - 1 are prompt tokens
            masked = max(len(prompt) - 1, 0)
            targets[:masked] = [IGNORE_INDEX] * masked
        targets = targets[:max_length]
        if all(t == IGNORE_INDEX for t in targets):  # its loss would be 0 / 0: NaN alone, dropped in a batch
            raise ValueError(f"row {len(rows)} of the batch: its prompt of {len(prompt)} tokens leaves no output token "
                             f"within max_length={max_length}; shorten it or raise max_length")
        rows.append((sequence[:-1][:max_length], targets))
    longest = max(len(inputs) for inputs, _ in rows)
    inputs = torch.full((len(rows), longest), pad_id, dtype=torch.long)  # (B, T)
    targets = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)  # (B, T)
    for i, (row_inputs, row_targets) in enumerate(rows):
        inputs[i, : len(row_inputs)] = torch.tensor(row_inputs, dtype=torch.long)
        targets[i, : len(row_targets)] = torch.tensor(row_targets, dtype=torch.long)
    return inputs, targets


def make_batches(encoded: Sequence[tuple[list[int], list[int]]], batch_size: int, eos_id: int,
                 mask_prompt: bool = False, max_length: int | None = None,
                 shuffle_seed: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``collate``d batches of the encoded examples, in a seeded random order if shuffle_seed is given."""
    order = list(range(len(encoded)))
    if shuffle_seed is not None:
        order = torch.randperm(len(order), generator=torch.Generator().manual_seed(shuffle_seed)).tolist()
    return [collate([encoded[i] for i in order[start : start + batch_size]], eos_id, mask_prompt=mask_prompt,
                    max_length=max_length) for start in range(0, len(order), batch_size)]


def lm_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Mean next-token loss over the targets that are not IGNORE_INDEX: the model's own loss path."""
    device = next(model.parameters()).device
    inputs, targets = (t.to(device) for t in batch)
    return model(inputs, targets=targets)  # () no (B, T, V) logits kept (llmscratch.model.losses)


class Replay:
    """Windows of pretraining text to mix into each finetuning batch (experience replay): the model keeps
    predicting the text it learned first, and so does not forget it while it learns the new task.

    ``tokens``: the pretraining text, encoded; each ``batch()`` is ``windows`` random windows of
    ``length`` + 1 tokens as (inputs, targets) (windows, length), drawn from a seeded generator.
    """

    def __init__(self, tokens: Sequence[int], windows: int, length: int, seed: int):
        if windows < 1 or length < 1:
            raise ValueError(f"replay needs at least one window of one token, got {windows} of {length}")
        if len(tokens) < length + 1:
            raise ValueError(f"the replay text has {len(tokens)} tokens, fewer than a window of {length} + 1")
        self.tokens = torch.as_tensor(tokens, dtype=torch.long)
        self.windows, self.length = windows, length
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(len(self.tokens) - self.length, (self.windows,), generator=self.generator).tolist()
        rows = torch.stack([self.tokens[start : start + self.length + 1] for start in starts])  # (W, L + 1)
        return rows[:, :-1], rows[:, 1:]  # (W, L), (W, L)


def lm_loss_with_replay(model: nn.Module, batch: tuple[tuple[torch.Tensor, torch.Tensor],
                                                        tuple[torch.Tensor, torch.Tensor] | None]) -> torch.Tensor:
    """``lm_loss`` of a finetuning batch plus, when the batch carries one, that of its replayed windows."""
    task, replayed = batch
    return lm_loss(model, task) + (lm_loss(model, replayed) if replayed is not None else 0.0)


@torch.no_grad()
def response_loss(model: nn.Module, encoded: Sequence[tuple[list[int], list[int]]], eos_id: int,
                  batch_size: int = 16, max_length: int | None = None, dtype: torch.dtype = torch.float32) -> float:
    """Loss (nats per token) on the outputs and their end-of-text token, the prompts masked."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    with evaluating(model):
        for inputs, targets in make_batches(encoded, batch_size, eos_id, mask_prompt=True, max_length=max_length):
            batch_count = int((targets != IGNORE_INDEX).sum())
            with autocast(device, dtype):
                mean = lm_loss(model, (inputs, targets))  # () over the batch's unmasked targets
            total += mean.item() * batch_count
            count += batch_count
    return total / count


# --------------------------------------------------------------------------- answers
@dataclass(frozen=True)
class Response:
    """A generated answer: its text (template stripped), whether it ended with <|endoftext|>,
    and whether it wrote template text (a new "### ..." section or the header)."""

    text: str
    finished: bool
    leaked: bool

    @property
    def well_formed(self) -> bool:
        return self.finished and not self.leaked


def parse_response(new_ids: Sequence[int], tokenizer, eos_id: int) -> Response:
    """The answer in generated ids: cut at end-of-text, and at any template text it starts writing."""
    ids = list(new_ids)
    finished = eos_id in ids
    text = tokenizer.decode(ids[: ids.index(eos_id)] if finished else ids)
    cuts = [text.index(marker) for marker in TEMPLATE_MARKERS if marker in text]
    if cuts:
        text = text[: min(cuts)]
    return Response(text.strip(), finished, leaked=bool(cuts))


def respond(model: nn.Module, tokenizer, records: Sequence[dict], max_new_tokens: int = 32, batch_size: int = 32,
            dtype: torch.dtype = torch.float32, progress: bool = False) -> list[Response]:
    """Greedy answers to the records' prompts, stopping at <|endoftext|> (via ``llmscratch.model.generate``).

    Prompts of equal token length share a batch, so no prompt is padded.
    """
    eos_id = tokenizer.eot_token
    if eos_id is None:
        raise ValueError("the tokenizer has no <|endoftext|> token to end answers with")
    device = next(model.parameters()).device
    context = model.config.context_length
    vocab_size = min(tokenizer.n_vocab, model.config.vocab_size)  # never an id that only pads the model's rows
    prompts = [with_bos(tokenizer, tokenizer.encode(format_prompt(r), disallowed_special=()))
               for r in validate_records(list(records))]
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        if len(prompt) >= context:
            raise ValueError(f"record {index}: its prompt has {len(prompt)} tokens, leaving no room to answer "
                             f"within context_length={context}")
        by_length.setdefault(len(prompt), []).append(index)
    responses: list[Response | None] = [None] * len(prompts)
    with progress_bar(progress, len(prompts), "answering", "prompt") as bar:
        for length, indices in by_length.items():
            steps = min(max_new_tokens, context - length + 1)  # the last new token is never fed back
            for start in range(0, len(indices), batch_size):
                chosen = indices[start : start + batch_size]
                idx = torch.tensor([prompts[i] for i in chosen], device=device)  # (b, length)
                with autocast(device, dtype):
                    out = generate(model, idx, steps, eos_id=eos_id, vocab_size=vocab_size)  # (b, length + n)
                for row, i in enumerate(chosen):
                    responses[i] = parse_response(out[row, length:].tolist(), tokenizer, eos_id)
                if bar is not None:
                    bar.update(len(chosen))
    return responses


def split_records(records: Sequence[dict], source: object, test_mode: bool = False) -> dict[str, list[dict]]:
    """The records of each of ``SPLITS``, by their "split" field (ValueError naming ``source`` and the record
    whose split is none of them, or a source without train or test records).

    test_mode keeps ``TEST_MODE_SIZES`` records of each split, taken at even steps: the bundled
    files list their records family by family, so every family is kept.
    """
    for index, record in enumerate(records):
        if record.get("split") not in SPLITS:
            raise ValueError(f"{source}, record {index}: field 'split' is {record.get('split')!r}, "
                             f"expected one of {SPLITS}")
    splits = {name: [r for r in records if r["split"] == name] for name in SPLITS}
    if test_mode:
        splits = {name: split[:: max(1, len(split) // TEST_MODE_SIZES[name])][: TEST_MODE_SIZES[name]]
                  for name, split in splits.items()}
    for name in ("train", "test"):
        if not splits[name]:
            raise ValueError(f"{source} has no {name!r} records")
    return splits


def read_json_records(path: Path) -> list:
    """The records of ``path``: a JSON list, or JSON Lines (one record per line, as many datasets ship).

    ValueError naming the file if it is not UTF-8 text, not JSON, or holds something else than a list.
    """
    text = read_text_file(path)
    try:
        records = json.loads(text)
    except JSON_ERRORS as err:
        lines = [line for line in text.splitlines() if line.strip()]
        if len(lines) < 2 or not lines[0].lstrip().startswith("{"):
            raise ValueError(f"{path} is not a JSON file: {err}") from None
        records = parse_json_lines(text, path, "a JSON list of records, or one JSON record per line")
    if not isinstance(records, list):
        raise ValueError(f"{path} holds a JSON {type(records).__name__}, expected a list of records (or one record "
                         f"per line)")
    return records


def read_instruction_splits(path: Path, test_mode: bool = False) -> dict[str, list[dict]]:
    """The instruction records of ``path`` (a JSON list), validated and grouped by split (``split_records``)."""
    try:
        records = validate_records(read_json_records(path))
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    return split_records(records, path, test_mode)


# --------------------------------------------------------------------------- scores
# Stripped from both ends of an answer: sentence marks, quotes and brackets. A minus sign, $ and %
# are kept ("-5" is not "5"), and so is punctuation inside the text ("u.s" stays "u.s").
SURROUNDING_PUNCTUATION = ".,;:!?\"'`()[]{}“”‘’«»"


def normalize_answer(text: str) -> str:
    """Lower case, runs of whitespace as one space, and no whitespace or punctuation at either end."""
    return " ".join(text.lower().split()).strip(SURROUNDING_PUNCTUATION + " ")


def exact_match(prediction: str, reference: str) -> bool:
    """Whether the two texts are equal once normalised (``normalize_answer``)."""
    return normalize_answer(prediction) == normalize_answer(reference)


def evaluate_responses(records: Sequence[dict], responses: Sequence[Response]) -> dict:
    """Exact match (normalised) overall and per family, and the share of well-formed answers.

    The two are separate measures: a right answer followed by template text counts as a match
    (its text is cut before the template) but not as well-formed.
    """
    if len(records) != len(responses) or not records:
        raise ValueError(f"need one response per record, and at least one; got {len(responses)} for {len(records)}")
    hits: dict[str, list[bool]] = {}
    for record, response in zip(records, responses):
        hit = exact_match(response.text, record["output"])
        hits.setdefault(record.get("family", "all"), []).append(hit)
    every = [hit for family in hits.values() for hit in family]
    return {"exact_match": sum(every) / len(every),
            "well_formed": sum(r.well_formed for r in responses) / len(responses),
            "by_family": {family: sum(h) / len(h) for family, h in sorted(hits.items())}}


def score_answers(model: nn.Module, tokenizer, records: Sequence[dict], encoded, eos_id: int, max_new_tokens: int,
                  dtype: torch.dtype = torch.float32, progress: bool = False) -> tuple[dict, list[Response]]:
    """The model's answers to ``records`` and their scores (``evaluate_responses``), with "response_loss", the
    loss on the reference answers (``encoded``: the records as ``encode_records`` gives them)."""
    answers = respond(model, tokenizer, records, max_new_tokens, dtype=dtype, progress=progress)
    scores = evaluate_responses(records, answers)
    scores["response_loss"] = response_loss(model, encoded, eos_id, max_length=model.config.context_length,
                                            dtype=dtype)
    return scores, answers


def answers_jsonl(records: Sequence[dict], answers: dict[str, Sequence[Response]]) -> str:
    """One JSON line per record: the record, each model's answer under its name, and whether the last
    model's answer was well-formed (``{name}_well_formed``)."""
    last = list(answers)[-1]
    lines = []
    for i, record in enumerate(records):
        row = {**record, **{name: responses[i].text for name, responses in answers.items()},
               f"{last}_well_formed": answers[last][i].well_formed}
        lines.append(json.dumps(row, ensure_ascii=False) + "\n")
    return "".join(lines)


def model_answers(path: Path, records: Sequence[dict], command: str, progress: bool = False) -> dict:
    """The greedy answers of the model file ``path`` to every record's prompt, with which model gave them (its
    sha256) and the ``command`` that asked: the content of chapter 6's answers file (``assets.dumps_answers``)."""
    model, tokenizer = load_model_and_tokenizer(path)
    responses = respond(model.eval(), tokenizer, records, MAX_NEW_TOKENS, progress=progress)
    answers = [{"instruction": r["instruction"], "input": r["input"], "split": r["split"], "answer": a.text,
                "well_formed": a.well_formed} for r, a in zip(records, responses)]
    sha256 = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    model_info = {"path": str(path), "sha256": sha256, "command": command, "max_new_tokens": MAX_NEW_TOKENS,
                  "decoding": "greedy, float32"}
    return {"model": model_info, "answers": answers}


def comparison_table(results: dict[str, dict]) -> str:
    """A Markdown table, one column per model: exact match per family, overall, well-formed, loss.

    results maps a model's name to ``evaluate_responses``'s dict, optionally with "response_loss" and
    "bits_per_byte" (on the held-out novel: what the model still knows of the text it was pretrained on).
    """
    def row(label: str, cells) -> str:
        return f"| {label} | " + " | ".join(cells) + " |"

    names = list(results)
    families = sorted({f for r in results.values() for f in r["by_family"]})
    lines = [row("exact match", names), "|---|" + "---:|" * len(names)]
    for family in families:
        lines.append(row(family, (f"{results[n]['by_family'].get(family, 0.0):.0%}" for n in names)))
    lines.append(row("**all families**", (f"**{results[n]['exact_match']:.1%}**" for n in names)))
    lines.append(row("well-formed answers", (f"{results[n]['well_formed']:.1%}" for n in names)))
    if all("response_loss" in r for r in results.values()):
        lines.append(row("held-out response loss", (f"{results[n]['response_loss']:.3f}" for n in names)))
    if all("bits_per_byte" in r for r in results.values()):
        lines.append(row("bits per byte, held-out Moby-Dick", (f"{results[n]['bits_per_byte']:.3f}" for n in names)))
    return "\n".join(lines)
