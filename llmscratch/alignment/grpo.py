"""Reinforcement learning with verifiable rewards: GRPO (Shao et al., 2024), from sampled groups to the update.

For each training prompt the policy samples a group of G answers. A checker scores each one:
1 for the family's exact answer, plus a small reward for an answer of the right form (it ends
with <|endoftext|> and is written like the family's answers). An answer's advantage is its reward
against its group's mean (divided by the group's spread, in GRPO proper): no value network, the
group is the baseline. The update raises the log-probability of the answers above their group's
mean and lowers the others, through PPO's clipped ratio (several updates on one batch of samples
cannot move the policy far from the one that sampled it), with an optional KL penalty to the
starting model. RL only sharpens what the model already does sometimes: pass@k, the chance that
at least one of k samples is right (``pass_at_k``, the unbiased estimator), shows what it can reach.
"""

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from llmscratch.alignment.config import GRPOConfig
from llmscratch.alignment.preference import ReferenceModel
from llmscratch.alignment.tasks import FAMILIES
from llmscratch.device import autocast
from llmscratch.finetuning.finetune import FinetuneStopped
from llmscratch.finetuning.instruct import Response, exact_match, format_prompt, parse_response, validate_records
from llmscratch.interrupt import StopRequest
from llmscratch.model.generate import generate
from llmscratch.model.losses import IGNORE_INDEX
from llmscratch.model.paged import PagedKVCache, feed
from llmscratch.progress import progress_bar
from llmscratch.training.optim import OptimizerStep

NORMALISATIONS = ("sequence", "token", "constant")


# --------------------------------------------------------------------------- rewards
def is_formed(record: dict, response: Response) -> bool:
    """Whether an answer has the right form: it ended with <|endoftext|>, wrote no template text, and (for a
    record of a known family) is written like that family's answers (letters apart, a number, words ...)."""
    if not response.well_formed:
        return False
    family = FAMILIES.get(record.get("family"))
    return family is None or bool(family.pattern.fullmatch(response.text))


def reward(record: dict, response: Response, format_weight: float) -> float:
    """1 for the right answer (``exact_match``) and ``format_weight`` for the right form (``is_formed``)."""
    return float(exact_match(response.text, record["output"])) + format_weight * is_formed(record, response)


# --------------------------------------------------------------------------- advantages and the objective
def group_advantages(rewards: torch.Tensor, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """Each answer's reward against its group's: rewards (P, G), G answers to each of P prompts -> (P, G).

    reward - the group's mean, divided by the group's standard deviation (torch's default, with
    Bessel's correction) + eps when ``scale``; a group whose answers all scored alike gets 0
    everywhere: it says nothing about which answer is better. scale=False is Dr. GRPO's choice
    (Liu et al., 2025): dividing by a small spread lets the groups that are nearly all right or
    all wrong weigh as much as the informative ones.
    """
    centred = rewards - rewards.mean(dim=-1, keepdim=True)  # (P, G)
    if not scale:
        return centred
    return centred / (rewards.std(dim=-1, keepdim=True) + eps)  # (P, G)


def clipped_objective(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                      clip: float) -> torch.Tensor:
    """PPO's clipped surrogate, per token (to be maximised): min(r A, clip(r, 1 - clip, 1 + clip) A).

    logprobs and old_logprobs (N, T): each answer token's log-probability under the policy being
    trained and under the one that sampled it; r = exp(logprobs - old_logprobs); advantages (N,):
    one per answer, the same for all of its tokens. The min makes the objective pessimistic: a
    ratio already past the clip in the advantage's direction gets no gradient.
    """
    ratio = torch.exp(logprobs - old_logprobs)  # (N, T)
    gain = advantages[:, None]  # (N, 1)
    return torch.minimum(ratio * gain, ratio.clamp(1 - clip, 1 + clip) * gain)  # (N, T)


def kl_penalty(logprobs: torch.Tensor, reference_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens: (N, T), never negative.

    Schulman's k3 estimator, exp(d) - d - 1 with d = log ref - log pi: unbiased for samples
    drawn from the policy, and lower in variance than -d (k1).
    """
    d = reference_logprobs - logprobs  # (N, T)
    return torch.exp(d) - d - 1  # (N, T)


def normalise(per_token: torch.Tensor, mask: torch.Tensor, how: str, max_tokens: int) -> torch.Tensor:
    """The loss of a batch from per-token values (N, T), counting only ``mask``ed tokens: a scalar.

    "sequence" (GRPO's paper): the mean over each answer's tokens, then over the answers, so a
    token of a short answer weighs more than one of a long answer. "token" (DAPO): the sum over
    all tokens divided by their number, every token weighs alike. "constant" (Dr. GRPO): the sum
    divided by a number that does not depend on the answers (N * max_tokens): no length bias at all.
    """
    masked = torch.where(mask, per_token, 0.0)  # (N, T)
    if how == "sequence":
        return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)).mean()
    if how == "token":
        return masked.sum() / mask.sum().clamp(min=1)
    if how == "constant":
        return masked.sum() / (per_token.shape[0] * max_tokens)
    raise ValueError(f"unknown normalisation {how!r}; expected one of {NORMALISATIONS}")


# --------------------------------------------------------------------------- pass@k
def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimate of pass@k from n samples of which ``correct`` were right (Chen et al., 2021).

    1 - C(n - c, k) / C(n, k): the chance that k samples drawn without replacement from the n
    include a right one. Taking 1 - (1 - c/n)**k instead is biased low: it samples with replacement.
    The product form below never builds the large binomials.
    """
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= correct <= n and 1 <= k <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:  # every draw of k includes a right answer
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - correct + 1, n + 1))


# --------------------------------------------------------------------------- sampling groups
@dataclass
class Group:
    """G sampled answers to one record's prompt: their ids (each ending with <|endoftext|> when it ended),
    parsed responses and rewards."""

    record: dict
    prompt: list[int]
    answers: list[list[int]]
    responses: list[Response]
    rewards: list[float]


def sample_groups(model: nn.Module, tokenizer, records: Sequence[dict], group_size: int, max_new_tokens: int,
                  temperature: float, generator: torch.Generator | None = None, format_weight: float = 0.0,
                  dtype: torch.dtype = torch.float32, batch_rows: int = 256) -> list[Group]:
    """``group_size`` sampled answers to each record's prompt, scored with ``reward``; in the records' order.

    Prompts of one token length are sampled together (rows of up to ``batch_rows``), so none is padded.
    """
    eos_id = tokenizer.eot_token
    device = next(model.parameters()).device
    records = validate_records(list(records))
    prompts = [tokenizer.encode(format_prompt(r), disallowed_special=()) for r in records]
    by_length: dict[int, list[int]] = {}
    for index, prompt in enumerate(prompts):
        by_length.setdefault(len(prompt), []).append(index)
    answers: list[list[list[int]]] = [[] for _ in records]
    per_batch = max(1, batch_rows // group_size)
    for length, indices in by_length.items():
        steps = min(max_new_tokens, model.config.context_length - length + 1)
        for start in range(0, len(indices), per_batch):
            chosen = indices[start : start + per_batch]
            idx = torch.tensor([prompts[i] for i in chosen], device=device)  # (p, length)
            with autocast(device, dtype):
                out = generate(model, idx, steps, temperature=temperature, eos_id=eos_id, generator=generator,
                               vocab_size=tokenizer.n_vocab, samples_per_prompt=group_size)  # (p * G, length + n)
            for row, new in enumerate(out[:, length:].tolist()):
                answers[chosen[row // group_size]].append(new[: new.index(eos_id) + 1] if eos_id in new else new)
    groups = []
    for record, prompt, sampled in zip(records, prompts, answers):
        responses = [parse_response(ids, tokenizer, eos_id) for ids in sampled]
        groups.append(Group(record, prompt, sampled, responses, [reward(record, r, format_weight) for r in responses]))
    return groups


def rollout_batch(groups: Sequence[Group], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (N, T) of every sampled answer, the prompt's targets IGNORE_INDEX: only the
    answer's tokens (its <|endoftext|> included, when it has one) are scored."""
    rows = [(g.prompt, answer) for g in groups for answer in g.answers]
    longest = max(len(p) + len(a) for p, a in rows) - 1
    inputs = torch.full((len(rows), longest), pad_id, dtype=torch.long)  # (N, T)
    targets = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)  # (N, T)
    for i, (prompt, answer) in enumerate(rows):
        sequence = prompt + answer
        inputs[i, : len(sequence) - 1] = torch.tensor(sequence[:-1])
        targets[i, len(prompt) - 1 : len(sequence) - 1] = torch.tensor(answer)
    return inputs, targets


def answer_logprobs(model: nn.Module, groups: Sequence[Group]) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability of every answer token (N, A), A the longest answer, and which are real (N, A):
    ``token_logprobs`` of ``rollout_batch``'s rows with their prompts cut off, computed faster.

    The G answers of a group share their prompt, which is most of each row: every prompt runs once into
    a paged cache (its last position predicts each answer's first token), each is forked for its answers,
    and all answers are then fed at once, attending to their prompt's keys and values in the shared
    blocks; gradients flow back through them (the cache's writes and reads are differentiable).
    """
    weight = next(model.parameters())
    device, wide = weight.device, torch.promote_types(weight.dtype, torch.float32)  # float64 for a float64 model
    rows = [(i, j) for i, group in enumerate(groups) for j in range(len(group.answers))]  # answer j of group i
    answers = [groups[i].answers[j] for i, j in rows]
    cache = _prompts_cache(model, groups)
    prompts = [(i, 0) for i in range(len(groups))]  # each prompt's sequence goes on as its first answer
    for seq_id in prompts:
        cache.add(seq_id, ())
    logits = feed(model, cache, prompts, [g.prompt for g in groups])  # (P, L, V), rows padded
    last = torch.tensor([len(g.prompt) - 1 for g in groups], device=device)  # (P,)
    firsts = logits[torch.arange(len(groups), device=device), last]  # (P, V): predicts each answer's first token
    logits = firsts[torch.tensor([i for i, _ in rows], device=device)][:, None]  # (N, 1, V)
    for i, j in rows:
        if j:
            cache.fork((i, 0), (i, j))
    fed = [row for row, answer in enumerate(answers) if len(answer) > 1]  # answer token t predicts token t + 1
    if fed:
        following = feed(model, cache, [rows[r] for r in fed], [answers[r][:-1] for r in fed])  # (F, A - 1, V)
        rest = following.new_zeros(len(rows), *following.shape[1:]).index_copy(
            0, torch.tensor(fed, device=device), following)  # (N, A - 1, V): rows of one-token answers all zero
        logits = torch.cat([logits, rest], dim=1)  # (N, A, V)
    longest = logits.size(1)
    targets = torch.zeros(len(rows), longest, dtype=torch.long, device=device)  # (N, A), 0-padded
    mask = torch.zeros(len(rows), longest, dtype=torch.bool, device=device)  # (N, A)
    for row, answer in enumerate(answers):
        targets[row, : len(answer)] = torch.tensor(answer)
        mask[row, : len(answer)] = True
    picked = torch.log_softmax(logits.to(wide), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (N, A)
    return torch.where(mask, picked, 0.0), mask


def _prompts_cache(model: nn.Module, groups: Sequence[Group]) -> PagedKVCache:
    """A paged cache with exactly the room ``answer_logprobs`` takes: each prompt once, each answer but its last token.

    Its blocks hold one position each: a prompt then ends on a full block, which its answers share as they are, and
    no block is ever copied on write (a copy in the autograd graph would cost a backward over the whole pool).
    """
    positions = sum(len(g.prompt) + sum(len(a) - 1 for a in g.answers) for g in groups)
    longest = max(len(g.prompt) + len(a) - 1 for g in groups for a in g.answers)
    # Every position stays in the cache until the forward that reads it (lookahead: all of them), so each layer
    # group needs the same room per sequence: the count of sequences is in units of the longest (a fraction; half
    # a position more for the rounding of the product back to blocks).
    return PagedKVCache(model, sequences=(positions + 0.5) / longest, block_size=1, max_model_len=longest,
                        lookahead=longest, prefix_sharing=False)


def pass_at_k_scores(model: nn.Module, tokenizer, records: Sequence[dict], samples: int, max_new_tokens: int,
                     temperature: float = 1.0, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """pass@k for k = 1 .. samples, overall and per family, from ``samples`` sampled answers to each record.

    Returns {"k": [1 .. samples], "all": [pass@k ...], "by_family": {family: [pass@k ...]}}; each
    value is the mean over the records of ``pass_at_k``.
    """
    generator = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    groups = sample_groups(model, tokenizer, records, samples, max_new_tokens, temperature, generator, dtype=dtype)
    ks = list(range(1, samples + 1))
    per_record: dict[str, list[list[float]]] = {}
    for group in groups:
        correct = sum(exact_match(r.text, group.record["output"]) for r in group.responses)
        per_record.setdefault(group.record.get("family", "all"), []).append(
            [pass_at_k(samples, correct, k) for k in ks])
    every = [row for rows in per_record.values() for row in rows]

    def mean(rows: list[list[float]]) -> list[float]:
        return [sum(column) / len(rows) for column in zip(*rows)]

    return {"k": ks, "all": mean(every), "by_family": {f: mean(rows) for f, rows in sorted(per_record.items())}}


# --------------------------------------------------------------------------- one step
def prompt_order(count: int, seed: int) -> Callable[[int], list[int]]:
    """take(n): the next n record indices, in a seeded shuffle that starts again once all are used."""
    rng, queue = random.Random(seed), []

    def take(n: int) -> list[int]:
        while len(queue) < n:
            more = list(range(count))
            rng.shuffle(more)
            queue.extend(more)
        chosen = queue[:n]
        del queue[:n]
        return chosen

    return take


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              config: GRPOConfig, reference_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """GRPO's loss on a batch of sampled answers, and what it did: the clipped objective's negative,
    normalised as ``config.normalisation`` says, plus ``config.kl_weight`` times the KL penalty.

    logprobs, old_logprobs, reference_logprobs and mask (N, T); advantages (N,).
    """
    objective = clipped_objective(logprobs, old_logprobs, advantages, config.clip)  # (N, T)
    loss = -normalise(objective, mask, config.normalisation, config.max_new_tokens)
    ratio = torch.exp(logprobs - old_logprobs).detach()  # (N, T)
    clipped = (ratio - 1).abs() > config.clip
    stats = {"clipped": (clipped & mask).sum().item() / max(mask.sum().item(), 1)}
    if config.kl_weight > 0:
        kl = normalise(kl_penalty(logprobs, reference_logprobs), mask, config.normalisation, config.max_new_tokens)
        loss = loss + config.kl_weight * kl
        stats["kl"] = kl.item()
    return loss, stats


def train_grpo(model: nn.Module, tokenizer, records: Sequence[dict], config: GRPOConfig, device: torch.device,
               progress: bool = True, stop: StopRequest | None = None) -> list[dict]:
    """Tune ``model`` with GRPO on the prompts of ``records`` for ``config.steps`` rounds; one record per round.

    Each round samples ``config.group_size`` answers to ``config.prompts_per_step`` prompts (in a
    seeded shuffle), scores them, and takes ``config.updates_per_step`` optimizer steps on the
    answers of the groups whose rewards differ (the others have no advantage to learn from). The
    model stays in eval mode: dropout would make the policy that samples differ from the one scored.
    Once ``stop.stop_requested`` is set, the round under way finishes and FinetuneStopped is raised.
    """
    records = validate_records(list(records))
    if not records:
        raise ValueError("there are no training prompts: the training split is empty")
    train_config = config.train_config()
    model.to(device).eval()
    optimizer_step = OptimizerStep(model, train_config, device, advice="try a lower learning rate")
    reference = ReferenceModel(model) if config.kl_weight > 0 else None
    generator = torch.Generator(device).manual_seed(config.seed)
    take = prompt_order(len(records), config.seed)
    history = []
    with progress_bar(progress, config.steps, "GRPO", "round") as bar:
        for step in range(1, config.steps + 1):
            start = time.perf_counter()
            with torch.no_grad():
                groups = sample_groups(model, tokenizer, [records[i] for i in take(config.prompts_per_step)],
                                       config.group_size, config.max_new_tokens, config.temperature, generator,
                                       config.format_weight, config.torch_dtype)
            rewards = torch.tensor([g.rewards for g in groups])  # (P, G)
            advantages = group_advantages(rewards, config.scale_advantages)  # (P, G)
            informative = [i for i, g in enumerate(groups) if rewards[i].max() > rewards[i].min()]
            record = {"step": step, "reward": rewards.mean().item(),
                      "correct": sum(exact_match(r.text, g.record["output"]) for g in groups for r in g.responses)
                      / rewards.numel(),
                      "formed": sum(is_formed(g.record, r) for g in groups for r in g.responses) / rewards.numel(),
                      "answer_tokens": sum(len(a) for g in groups for a in g.answers) / rewards.numel(),
                      "informative_groups": len(informative) / len(groups), "loss": 0.0, "clipped": 0.0}
            if informative:
                learned = [groups[i] for i in informative]
                gains = advantages[informative].flatten().to(device)  # (N,)
                with torch.no_grad(), autocast(device, config.torch_dtype):
                    old = answer_logprobs(model, learned)[0] if config.updates_per_step > 1 else None  # (N, A)
                    ref = reference.apply(answer_logprobs, learned)[0] if reference is not None else None
                stats: dict = {}

                def loss_fn(_):
                    logprobs, mask = answer_logprobs(model, learned)  # (N, A), (N, A)
                    loss, found = grpo_loss(logprobs, logprobs.detach() if old is None else old, gains, mask,
                                            config, ref)
                    stats.update(found)
                    return loss

                losses = [optimizer_step([None], loss_fn)[0] for _ in range(config.updates_per_step)]
                record.update(loss=sum(losses) / len(losses), **stats)
            record["seconds"] = time.perf_counter() - start
            history.append(record)
            if bar is not None:
                bar.set_postfix(reward=f"{record['reward']:.2f}", correct=f"{record['correct']:.0%}", refresh=False)
                bar.update(1)
            if stop is not None and stop.stop_requested and step < config.steps:
                raise FinetuneStopped(step, config.steps, history)
    return history


# --------------------------------------------------------------------------- reports
SHOWN_K = (1, 4, 16)  # the pass@k columns of pass_at_k_table, where a run sampled that many


def pass_at_k_table(results: dict[str, dict]) -> str:
    """A Markdown table: pass@k per family and overall, for each model (``results``: name -> scores with a
    "pass_at_k" from ``pass_at_k_scores``) and each k of SHOWN_K that the runs sampled."""
    names = list(results)
    samples = results[names[0]]["pass_at_k"]["k"]
    ks = [k for k in SHOWN_K if k <= len(samples)] or [len(samples)]
    header = [f"{name} pass@{k}" for name in names for k in ks]
    lines = ["| family | " + " | ".join(header) + " |", "|---|" + "---:|" * len(header)]
    families = list(results[names[0]]["pass_at_k"]["by_family"])
    for label, pick in [*((f, lambda p, f=f: p["by_family"][f]) for f in families),
                        ("**all families**", lambda p: p["all"])]:
        cells = [f"{pick(results[n]['pass_at_k'])[k - 1]:.0%}" for n in names for k in ks]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_rl(history: list[dict], pass_curves: dict[str, dict | None], path) -> None:
    """rl.png: the mean reward and the share of right answers per round; pass@k against k for each model."""
    from matplotlib.figure import Figure  # no pyplot: no global backend

    fig = Figure(figsize=(10, 3.6))
    reward_ax, pass_ax = fig.subplots(1, 2)
    steps = [r["step"] for r in history]
    reward_ax.plot(steps, [r["reward"] for r in history], lw=0.8, label="mean reward")
    reward_ax.plot(steps, [r["correct"] for r in history], lw=0.8, label="right answers (sampled)")
    reward_ax.set_title("training rounds")
    reward_ax.set_xlabel("round")
    for name, curve in pass_curves.items():
        if curve is not None:
            pass_ax.plot(curve["k"], curve["all"], "o-", markersize=3, label=name)
    pass_ax.set_xscale("log", base=2)
    pass_ax.set_title("pass@k on the test prompts")
    pass_ax.set_xlabel("k (samples per prompt)")
    for ax in (reward_ax, pass_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
