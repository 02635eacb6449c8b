"""Decoding benchmark: greedy gpt2-small, ours (KV cache eager and compiled, no cache, bf16) vs transformers.

    python -m benchmarks.bench_generate      # from the repository root; prints a Markdown section
    python -m benchmarks.bench_generate --device cuda --candidates transformers cache compiled compiled-cuda-graphs \
        --json decode.json                   # on a GPU: also the compiled step replayed as a CUDA graph

Batch 1, random weights shared by every candidate (transformers' own init, loaded into ours with
load_hf), greedy, no EOS. Candidates run in interleaved rounds in one process, so machine noise
hits them alike; medians are reported. Each round also times a sum over a tensor as large as the
fp32 weights: the machine's read bandwidth at that moment, from which the memory floor follows
(batch-1 decoding reads every weight once per token, so tokens/s <= bandwidth / bytes per token).
--json also writes every number (see ``to_json`` for the keys).
"""

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # random weights: nothing to download

import transformers  # noqa: E402

from benchmarks.common import (add_threads_flag, device_flag, device_name, load_average,  # noqa: E402
                               machine_description, median, set_threads, today)
from llmscratch.files import write_json_atomically  # noqa: E402
from llmscratch.model.decode_kernels import one_row_linear  # noqa: E402
from llmscratch.model.generate import generate  # noqa: E402
from llmscratch.model.gpt import GPT  # noqa: E402
from llmscratch.model.weights import load_hf  # noqa: E402
from llmscratch.profiling import time_once  # noqa: E402

LABELS = {
    "transformers": "transformers {version} `generate` (DynamicCache, SDPA), fp32",
    "transformers-bf16": "transformers {version} `generate`, bf16 weights",
    "cache": "llmscratch `generate`, KV cache, fp32",
    "cache-bf16": "llmscratch `generate`, KV cache, bf16 weights",
    "compiled": "llmscratch `generate(compile=True)`, KV cache, decode step compiled, fp32",
    "compiled-cuda-graphs": "llmscratch `generate(compile='cuda-graphs')`, KV cache, decode step compiled and "
                            "replayed as a CUDA graph, fp32",
    "no-cache": "llmscratch `generate`, `use_cache=False`, fp32",
}
FP32_CANDIDATES = ("cache", "compiled", "compiled-cuda-graphs", "no-cache")  # ours: transformers' tokens exactly


def bytes_read_per_token(model: GPT, prompt_tokens: int, new_tokens: int) -> float:
    """Bytes one decoding step reads from memory, averaged over the steps of one call.

    Every weight once (a tied embedding once, as the output head), except the position table of
    which one row is read; plus the KV cache read by attention, which grows by a token a step.
    """
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.position_embedding is not None:
        table = model.position_embedding.weight
        weights -= (table.size(0) - 1) * table.size(1) * table.element_size()
    config = model.config
    mean_length = prompt_tokens + (new_tokens - 1) / 2  # cached positions read, averaged over steps
    cache = 2 * config.n_layers * config.kv_heads * config.head_dim * mean_length * model.lm_head.weight.element_size()
    return weights + cache


def read_bandwidth(tensor: torch.Tensor, reads: int = 3) -> float:
    """Bytes per second of the fastest of a few full reads of tensor (a sum: one pass, nothing written).

    The fastest, because bandwidth is a ceiling: a slower read was disturbed by something else.
    """
    return tensor.numel() * tensor.element_size() / min(time_once(tensor.sum, tensor.device) for _ in range(reads))


def matrix_vector_kernels(model: GPT, rounds: int = 5) -> dict[str, float]:
    """Decoding steps/s of the model's matrix-vector products alone, by kernel, and the read floor.

    One step = every weight matrix (and the output head) times one activation vector: the part
    of a decoding step that reads the weights. Interleaved rounds, medians, on the model's device.
    """
    device = model.lm_head.weight.device
    fp32 = [m.weight.detach() for m in model.modules() if isinstance(m, torch.nn.Linear)]  # head included
    bf16 = [w.bfloat16() for w in fp32]
    inputs32 = [torch.randn(1, w.size(1)).to(device) for w in fp32]
    inputs16 = [x.bfloat16() for x in inputs32]
    kernels = {
        "fp32 F.linear": lambda: [F.linear(x, w) for x, w in zip(inputs32, fp32)],
        "bf16 F.linear": lambda: [F.linear(x, w) for x, w in zip(inputs16, bf16)],
    }
    if device.type == "cpu" and torch.get_num_threads() > 1:  # the compiled step's own products there
        multiply_sum = torch.compile(lambda xs, ws: [one_row_linear(x, w, None) for x, w in zip(xs, ws)])
        kernels["fp32 multiply-sum, compiled"] = lambda: multiply_sum(inputs32, fp32)
        kernels["fp32 multiply-sum, compiled"]()  # compiled here, not in the first timed round
    packed = None
    if (device.type == "cpu" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        # oneDNN with weights reordered once into its blocked layout: what torch.compile's CPU
        # backend does with frozen weights (torch._inductor.config.freezing).
        try:
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in bf16]
        except RuntimeError:  # oneDNN's bf16 path needs AVX-NE-CONVERT or AVX-512 (BW, VL, DQ)
            packed = None
    if packed is not None:
        kernels["bf16 oneDNN, prepacked"] = lambda: [
            torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for x, w in zip(inputs16, packed)]
    reader = torch.ones(sum(w.numel() for w in fp32), device=device)
    times = {name: [] for name in kernels}
    floors = []
    for _ in range(rounds):
        floors.append(read_bandwidth(reader) / (reader.numel() * 4))
        for name, kernel in kernels.items():
            times[name].append(time_once(kernel, device))
    rates = {name: 1 / median(runs) for name, runs in times.items()}
    return {"floor fp32": median(floors), "floor bf16": 2 * median(floors), **rates}


def print_profile(model: GPT, idx: torch.Tensor, new_tokens: int, compile: bool = False) -> None:
    """torch.profiler's top operators over one cached greedy call (compiled: after the warm-up's compile)."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, idx, new_tokens, compile=compile)
    print(f"```\n{prof.key_averages().table(sort_by='self_cpu_time_total', row_limit=12)}\n```\n")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="interleaved rounds; medians are reported (default 5)")
    parser.add_argument("--no-cache-runs", type=int, default=None,
                        help="how many of those rounds include the slow no-cache path (default: 3, at most --runs)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="prompt length, batch 1 (default 32)")
    parser.add_argument("--new-tokens", type=int, default=200, help="tokens generated per call (default 200)")
    add_threads_flag(parser)
    parser.add_argument("--profile", action="store_true",
                        help="also print torch.profiler's top operators of one cached fp32, one bf16 and one "
                             "compiled fp32 call (CPU only)")
    parser.add_argument("--device", default="cpu",
                        help="cpu, cuda or cuda:N (default cpu): where the models decode and the read bandwidth "
                             "is measured")
    parser.add_argument("--candidates", nargs="+", choices=list(LABELS), default=None, metavar="NAME",
                        help=f"what to time, among {', '.join(LABELS)}; transformers (the reference) is required "
                             f"(default: all but compiled-cuda-graphs on a CPU, all but no-cache on CUDA)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write every measured number to this JSON file (written atomically at the end)")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs must be at least 1, got {args.runs}")
    if args.no_cache_runs is None:
        args.no_cache_runs = min(3, args.runs)
    if not 0 <= args.no_cache_runs <= args.runs:
        parser.error(f"--no-cache-runs must be between 0 and --runs={args.runs}, got {args.no_cache_runs}")
    if args.prompt_tokens < 1 or args.new_tokens < 1 or args.prompt_tokens + args.new_tokens > 1024:
        parser.error(f"need a prompt and new tokens of at least 1 that together fit gpt2-small's 1024 "
                     f"positions; got {args.prompt_tokens} + {args.new_tokens}")
    args.device = device_flag(parser, args.device)
    cuda = args.device.type == "cuda"
    if args.candidates is None:
        args.candidates = [name for name in LABELS if name != ("no-cache" if cuda else "compiled-cuda-graphs")]
    if "transformers" not in args.candidates:
        parser.error("--candidates must include transformers: every other candidate is compared with it")
    if "compiled-cuda-graphs" in args.candidates and not cuda:
        parser.error("--candidates compiled-cuda-graphs needs --device cuda: CUDA graphs replay GPU kernels")
    if args.profile and cuda:
        parser.error("--profile lists CPU operators only; leave it out with --device cuda")
    if args.json is not None and args.json.is_dir():
        parser.error(f"--json {args.json} is a folder; give the path of the file to write")
    set_threads(parser, args.threads)
    return args


def gpt2_models(device: torch.device, transformers_bf16: bool = True) -> tuple[dict[str, torch.nn.Module], int]:
    """transformers' GPT-2 with its own random init and no EOS (every call generates all tokens), and
    ours with the very same weights loaded from its checkpoint; each in fp32 and in bf16 (transformers'
    only if transformers_bf16), on ``device``. Also the vocabulary size."""
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    config = transformers.GPT2Config(bos_token_id=None, eos_token_id=None)
    theirs = transformers.GPT2LMHeadModel(config).eval()
    with tempfile.TemporaryDirectory() as folder:
        theirs.save_pretrained(folder)
        ours = load_hf(folder).eval()
        ours_bf16 = load_hf(folder, dtype=torch.bfloat16).eval()
    models = {"theirs": theirs, "ours": ours, "ours_bf16": ours_bf16}
    if transformers_bf16:
        theirs_bf16 = transformers.GPT2LMHeadModel(config).eval()
        theirs_bf16.load_state_dict(theirs.state_dict())
        models["theirs_bf16"] = theirs_bf16.to(torch.bfloat16)
    return {name: model.to(device) for name, model in models.items()}, config.vocab_size


def decoders_of(models: dict[str, torch.nn.Module], idx: torch.Tensor,
                candidates: list[str]) -> dict[str, Callable[[int], torch.Tensor]]:
    """Each candidate as a call that greedily decodes n new tokens after the prompt idx (1, T), in LABELS' order."""
    def hf(name):
        return lambda n: models[name].generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n,
                                               do_sample=False)

    ours, ours_bf16 = models["ours"], models["ours_bf16"]
    every = {
        "transformers": hf("theirs"),
        "transformers-bf16": hf("theirs_bf16"),
        "cache": lambda n: generate(ours, idx, n),
        "cache-bf16": lambda n: generate(ours_bf16, idx, n),
        "compiled": lambda n: generate(ours, idx, n, compile=True),
        "compiled-cuda-graphs": lambda n: generate(ours, idx, n, compile="cuda-graphs"),
        "no-cache": lambda n: generate(ours, idx, n, use_cache=False),
    }
    return {name: decode for name, decode in every.items() if name in candidates}


def time_rounds(args, decoders, fp32_bytes: float) -> tuple[dict, dict, list[float]]:
    """Interleaved rounds of every candidate, each round also measuring the read bandwidth.

    Returns each candidate's last output, its wall times, and the bandwidths in bytes per second.
    """
    for name, decode in decoders.items():  # warm-up: first-call allocations and kernel choices
        # The compiled step is compiled (and its CUDA graph recorded) for the caches' length: warm it up at
        # the timed length.
        decode(args.new_tokens if name.startswith("compiled") else 8)
    reader = torch.ones(int(fp32_bytes) // 4, device=args.device)  # as many bytes as one fp32 decoding step reads
    outputs, times, bandwidths = {}, {name: [] for name in decoders}, []
    for round_index in tqdm(range(args.runs), desc="interleaved rounds", file=sys.stderr):
        bandwidths.append(read_bandwidth(reader))
        for name, decode in decoders.items():
            if name == "no-cache" and round_index >= args.no_cache_runs:
                continue
            times[name].append(time_once(lambda: outputs.__setitem__(name, decode(args.new_tokens)), args.device))
    return outputs, times, bandwidths


def main() -> None:
    args = parse_args()
    models, vocab_size = gpt2_models(args.device, "transformers-bf16" in args.candidates)
    ours, ours_bf16 = models["ours"], models["ours_bf16"]
    idx = torch.randint(vocab_size, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
    idx = idx.to(args.device)
    fp32_bytes = bytes_read_per_token(ours, args.prompt_tokens, args.new_tokens)
    bf16_bytes = bytes_read_per_token(ours_bf16, args.prompt_tokens, args.new_tokens)
    outputs, times, bandwidths = time_rounds(args, decoders_of(models, idx, args.candidates), fp32_bytes)
    expected = outputs["transformers"]
    if args.device.type == "cpu":  # on a GPU each implementation's kernels round differently: reported, not asserted
        for name in FP32_CANDIDATES:
            if name in outputs:
                assert torch.equal(outputs[name], expected), f"{name}: greedy tokens differ from transformers"
    # How many new tokens stay identical to transformers' fp32 ones: all of them for the fp32 candidates on a
    # CPU; bf16 weights round differently, and so may a GPU's kernels.
    agree = {name: int((output[0] == expected[0]).long().cumprod(0).sum()) - args.prompt_tokens
             for name, output in outputs.items()}
    kernels = matrix_vector_kernels(ours)
    if args.json is not None:
        write_json_atomically(args.json, to_json(args, times, bandwidths, fp32_bytes, bf16_bytes, agree, kernels))
    report(args, times, bandwidths, fp32_bytes, bf16_bytes, agree)
    compiled = next((name for name in ("compiled-cuda-graphs", "compiled") if name in times), None)
    report_kernels(kernels, compiled and rate_of(args, times, compiled), compiled)
    if args.profile:
        for model in (ours, ours_bf16):
            print(f"\ntorch.profiler, one cached call in {model.lm_head.weight.dtype}:\n")
            print_profile(model, idx, args.new_tokens)
        print("\ntorch.profiler, one compiled call in torch.float32:\n")
        print_profile(ours, idx, args.new_tokens, compile=True)


def to_json(args, times, bandwidths, fp32_bytes, bf16_bytes, agree, kernels) -> dict:
    """Every number of the run: the machine and versions, the bandwidth and floors, then ``candidates[name]``.

    bandwidth (median bytes/s of the rounds' reads) with bandwidth_range [min, max]; bytes_per_token and
    floor_tokens_per_s, each {fp32, bf16}; tokens_asserted (the fp32 candidates' tokens were asserted equal to
    transformers', on a CPU). Each candidate: label, precision, runs, seconds (each timed call), median_s,
    tokens_per_s (new tokens over median_s) with tokens_per_s_range [min, max], vs_transformers (over
    transformers' fp32 tokens/s), floor_share (of its precision's memory floor) and agreement (new tokens
    equal to transformers' fp32 ones, from the first). kernels: matrix_vector_kernels' steps/s.
    """
    bandwidth = median(bandwidths)
    floor = {"fp32": bandwidth / fp32_bytes, "bf16": bandwidth / bf16_bytes}
    candidates = {}
    for name, runs in times.items():
        if not runs:  # no-cache with --no-cache-runs 0
            continue
        precision = "bf16" if name.endswith("bf16") else "fp32"
        rate = rate_of(args, times, name)
        candidates[name] = {"label": LABELS[name].format(version=transformers.__version__), "precision": precision,
                            "runs": len(runs), "seconds": runs, "median_s": median(runs), "tokens_per_s": rate,
                            "tokens_per_s_range": [args.new_tokens / max(runs), args.new_tokens / min(runs)],
                            "vs_transformers": rate / rate_of(args, times, "transformers"),
                            "floor_share": rate / floor[precision], "agreement": agree[name]}
    return {"benchmark": "generate", "date": today(), "command": command(), "machine": machine_description(),
            "device": str(args.device), "device_name": device_name(args.device), "torch": torch.__version__,
            "transformers": transformers.__version__, "load_average": load_average(),
            "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "runs": args.runs,
            "tokens_asserted": args.device.type == "cpu", "bandwidth": bandwidth,
            "bandwidth_range": [min(bandwidths), max(bandwidths)],
            "bytes_per_token": {"fp32": fp32_bytes, "bf16": bf16_bytes}, "floor_tokens_per_s": floor,
            "candidates": candidates, "kernels": kernels}


def command() -> str:
    return " ".join(["python -m benchmarks.bench_generate", *sys.argv[1:]])


def report_kernels(kernel_rates: dict[str, float], compiled_rate: float | None, compiled: str | None) -> None:
    """The compiled step (if one ran) against the matrix-vector products alone, and the table of those products."""
    if compiled is not None:
        how = " with CUDA graphs" if compiled == "compiled-cuda-graphs" else ""
        own = kernel_rates.get("fp32 multiply-sum, compiled")
        mine = (f"; {compiled_rate / own:.0%} of the rate of the same products computed as it computes them, "
                f"a compiled multiply-sum per matrix (llmscratch/model/decode_kernels.py)" if own else "")
        print(f"\nCompiled decoding{how}, fp32: {compiled_rate / kernel_rates['fp32 F.linear']:.0%} of "
              f"the rate of the fp32 matrix-vector products alone by `F.linear` (below; target where the floor is "
              f"out of their reach: at least 90%){mine}.")
    print("\nWhere a step's time goes: the matrix-vector products alone (every weight matrix and the "
          "head times one vector), in decoding steps/s, medians of 5 interleaved rounds, against the "
          "read floor of the same bytes:\n")
    print("| matrix-vector products of one step | steps/s | share of its memory floor |")
    print("|---|---|---|")
    for name, rate in kernel_rates.items():
        if not name.startswith("floor"):
            floor = kernel_rates["floor bf16" if name.startswith("bf16") else "floor fp32"]
            print(f"| {name} | {rate:.1f} | {rate / floor:.0%} |")


def rate_of(args, times, name) -> float:
    """Tokens/s of one candidate: new tokens over the median wall time of its calls."""
    return args.new_tokens / median(times[name])


def report(args, times, bandwidths, fp32_bytes, bf16_bytes, agree) -> None:
    rate = {name: rate_of(args, times, name) for name, runs in times.items() if runs}
    bandwidth = median(bandwidths)
    floor = {"fp32": bandwidth / fp32_bytes, "bf16": bandwidth / bf16_bytes}
    cuda = args.device.type == "cuda"
    print(f"### Decoding ({today()})\n")
    print(f"Command: `{command()}`  ")
    print(f"Machine: {machine_description()}{f'; GPU: {device_name(args.device)}' if cuda else ''}; "
          f"load average {load_average()} at the end  ")
    print(f"Model: gpt2-small shape (124M parameters), random weights, eval; batch 1, a {args.prompt_tokens}-token "
          f"prompt, {args.new_tokens} new tokens, greedy. Tokens/s = new tokens / wall time of the whole call, "
          f"prefill included; medians of interleaved rounds after a warm-up. {agreement(args, agree)}\n")
    print(f"Read bandwidth (the fastest of 3 sums over a {fp32_bytes / 1e6:.0f} MB fp32 tensor, each round; "
          f"median of {len(bandwidths)} rounds): {bandwidth / 1e9:.1f} GB/s. Bytes read per decoding step: "
          f"{fp32_bytes / 1e6:.0f} MB in fp32, {bf16_bytes / 1e6:.0f} MB in bf16 (every weight once, the tied embedding once, plus the "
          f"KV cache at its mean length). Memory floor: {floor['fp32']:.1f} tokens/s in fp32, "
          f"{floor['bf16']:.1f} in bf16.\n")
    print("| greedy decoding | runs | seconds | tokens/s | vs transformers fp32 | share of the memory floor |")
    print("|---|---|---|---|---|---|")
    for name, label in LABELS.items():
        if name not in rate:
            continue
        precision = "bf16" if name.endswith("bf16") else "fp32"
        print(f"| {label.format(version=transformers.__version__)} | {len(times[name])} | "
              f"{median(times[name]):.2f} | {rate[name]:.1f} | {rate[name] / rate['transformers']:.2f} | "
              f"{rate[name] / floor[precision]:.0%} ({precision}) |")
    if len(rate) > 1:
        print("\n" + "\n".join(targets(rate, floor)))


def agreement(args, agree: dict[str, int]) -> str:
    """The sentence on tokens: asserted identical in fp32 on a CPU, else how long each follows transformers'."""
    if args.device.type == "cuda":
        each = ", ".join(f"{name} {count}" for name, count in agree.items() if name != "transformers")
        return (f"Tokens are not asserted on a GPU, where each implementation's kernels round differently: each "
                f"candidate follows transformers' fp32 greedy tokens for its first N of {args.new_tokens} new tokens "
                f"({each}).")
    bf16 = [f"{agree[name]} ({who})" for name, who in (("cache-bf16", "ours"), ("transformers-bf16", "transformers"))
            if name in agree]
    if not bf16:
        return "The fp32 candidates produce identical tokens (asserted)."
    return (f"The fp32 candidates produce identical tokens (asserted); the bf16 ones follow transformers' fp32 "
            f"tokens for their first {' and '.join(bf16)} new tokens: random weights leave near-ties everywhere, "
            f"and bf16 rounding soon picks another token.")


def targets(rate: dict[str, float], floor: dict[str, float]) -> list[str]:
    """One line per measured candidate with a target: its speed against transformers and the memory floor."""
    lines = []
    if "cache" in rate:
        line = (f"KV cache, fp32: {rate['cache'] / rate['transformers']:.2f}x transformers (target: at least 1x, "
                f"issue 4; at least 1.1x, issue 7) and {rate['cache'] / floor['fp32']:.0%} of the fp32 memory floor "
                f"(target: at least 85%).")
        if "no-cache" in rate:
            line += f" {rate['cache'] / rate['no-cache']:.1f}x no cache (target: at least 5x)."
        lines.append(line)
    if "compiled" in rate:
        eager = f", {rate['compiled'] / rate['cache']:.2f}x the eager cache," if "cache" in rate else ""
        lines.append(f"Compiled decode step, fp32: {rate['compiled'] / rate['transformers']:.2f}x transformers "
                     f"(target: at least 1.2x, issue 13){eager} and {rate['compiled'] / floor['fp32']:.0%} of the "
                     f"fp32 memory floor (target: at least 85%).")
    if "compiled-cuda-graphs" in rate:
        graphs = rate["compiled-cuda-graphs"]
        compiled = f", {graphs / rate['compiled']:.2f}x the compiled step without them," if "compiled" in rate else ""
        lines.append(f"Compiled decode step with CUDA graphs, fp32: {graphs / rate['transformers']:.2f}x "
                     f"transformers{compiled} and {graphs / floor['fp32']:.0%} of the fp32 memory floor.")
    if "cache-bf16" in rate:
        lines.append(f"bf16 weights: {rate['cache-bf16'] / rate['transformers']:.2f}x transformers' fp32 figure "
                     f"(target: at least 1.8x).")
    return lines


if __name__ == "__main__":
    main()
