"""Serve a model over HTTP: an OpenAI-compatible API with continuous batching, and a chat page.

    python ch07-deployment/serve.py                          # the bundled base model, http://127.0.0.1:8000
    python ch07-deployment/serve.py --model instructions     # ch05's instruction follower (chat page at /)
    python ch07-deployment/serve.py --model dpo --host 0.0.0.0 --port 8080 --api-key "$KEY"
    python ch07-deployment/serve.py --model ~/models/Qwen3-0.6B       # a Hugging Face folder, in its chat format

Then open http://127.0.0.1:8000/ in a browser, or talk to it with curl or the official openai
client (base_url "http://127.0.0.1:8000/v1"); docs/serving.md shows both. Endpoints: /v1/completions
(with logprobs, echo and lists of prompts, for evaluation harnesses), /v1/chat/completions (streamed with
"stream": true), /v1/models, /health, /metrics; without keys also vLLM's /tokenize, /detokenize, /tokenizer_info.

API keys come from --api-key (repeatable) and from the environment variable LLMSCRATCH_API_KEYS
(comma-separated). With none the server answers anyone who can reach it, so it then listens on
127.0.0.1 only (another --host needs a key) and answers only requests whose Host header names it.
Behind a reverse proxy, name it with --trusted-proxy so that its X-Forwarded-For is believed.
"""

import argparse
import ipaddress
import os
from pathlib import Path

import torch

from llmscratch.cli import check_device, resolve_model, run_script, value_errors_exit
from llmscratch.deployment.engine import BATCH_SHAPES, PREFILL_CHUNK, Engine
from llmscratch.deployment.guard import MAX_BODY_BYTES, READ_TIMEOUT, SHUTDOWN_GRACE, make_server
from llmscratch.deployment.server import create_app
from llmscratch.device import DTYPES
from llmscratch.model.quantize import describe
from llmscratch.model.weights import load_model_and_tokenizer
from llmscratch.text.chat_template import ChatTemplate

KEYS_VARIABLE = "LLMSCRATCH_API_KEYS"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="\n".join(__doc__.splitlines()[1:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--model", default="base", metavar="MODEL",
        help="base (bundled), instructions, dpo, a run folder or a model file, quantized ones included (default base)")
    add("--name", default=None, help="the model's name in the API, what clients pass as 'model' (default: --model's)")
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    add("--port", type=int, default=8000, help="port to listen on (default 8000)")
    add("--api-key", action="append", default=[], metavar="KEY",
        help=f"a key clients must send as 'Authorization: Bearer KEY'; repeat for several (also ${KEYS_VARIABLE})")
    add("--rate-limit", type=int, default=None, metavar="N",
        help="at most N requests per minute per key (per address without keys); default: no limit")
    add("--trusted-proxy", action="append", default=[], metavar="ADDRESS",
        help="a reverse proxy whose X-Forwarded-For names the client; repeat for several (default: none, so the "
             "client's address is the connection's)")
    add("--max-body-mib", type=float, default=MAX_BODY_BYTES / 2**20, metavar="MIB",
        help=f"largest request body, in MiB; larger ones get 413 (default {MAX_BODY_BYTES / 2**20:g})")
    add("--read-timeout", type=float, default=READ_TIMEOUT, metavar="SECONDS",
        help=f"time for a request's headers, and then its body, to arrive; slower ones are closed or get 408 "
             f"(default {READ_TIMEOUT:g})")
    add("--shutdown-grace", type=float, default=SHUTDOWN_GRACE, metavar="SECONDS",
        help=f"at SIGTERM or Ctrl-C, time running answers get to finish before they end with an error event "
             f"(default {SHUTDOWN_GRACE:g})")
    add("--max-slots", type=int, default=16, help="sequences decoded together (default 16)")
    add("--kv-memory", type=float, default=None, metavar="GIB",
        help="the KV cache's budget in GiB, a pool of blocks the sequences share; more running sequences than fit "
             "wait, or the newest is preempted and recomputed later (default: what --max-slots sequences of "
             "--max-model-len need, at most half the memory free at start)")
    add("--max-model-len", type=int, default=None, metavar="TOKENS",
        help="the longest prompt + answer a request may ask for (default: the model's context)")
    add("--prefill-chunk", type=int, default=PREFILL_CHUNK, metavar="TOKENS",
        help=f"prompt tokens prefilled per step between decoding steps, so that running answers keep moving "
             f"while a long prompt is read (default {PREFILL_CHUNK})")
    add("--no-prefix-sharing", action="store_true",
        help="compute every prompt whole, even where an earlier one started with the same tokens")
    add("--max-waiting", type=int, default=64,
        help="requests queued for a free slot; more are refused at once with 503 (default 64)")
    add("--batch-shape", choices=BATCH_SHAPES, default="occupied",
        help="occupied: each step decodes the rows in use; fixed: always --max-slots rows, so that an answer's "
             "arithmetic never depends on what else runs (slower when few run; default occupied)")
    add("--dtype", choices=sorted(DTYPES), default="float32",
        help="precision of the weights and the computation (default float32; a quantized model keeps its integers)")
    add("--device", default="auto", help="'cpu', 'cuda', 'cuda:1', 'mps', ... (default: cuda if available, else cpu)")
    args = parser.parse_args(argv)
    keys = args.api_key + os.environ.get(KEYS_VARIABLE, "").split(",")
    args.api_key = [key.strip() for key in keys if key.strip()]  # as a client's header is read: spaces stripped
    try:
        args.name_default, args.model = resolve_model(args.model)
    except ValueError as err:
        parser.error(str(err))
    check_device(parser, args)
    if not 0 < args.port < 65536:
        parser.error(f"--port must be between 1 and 65535, got {args.port}")
    for flag, value in (("--max-slots", args.max_slots), ("--max-waiting", args.max_waiting),
                        ("--rate-limit", args.rate_limit), ("--max-model-len", args.max_model_len),
                        ("--prefill-chunk", args.prefill_chunk)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
    for flag, value in (("--max-body-mib", args.max_body_mib), ("--read-timeout", args.read_timeout),
                        ("--kv-memory", 1 if args.kv_memory is None else args.kv_memory)):
        if not value > 0:  # not: NaN too
            parser.error(f"{flag} must be more than 0, got {value}")
    if not args.shutdown_grace >= 0:
        parser.error(f"--shutdown-grace must be 0 or more, got {args.shutdown_grace}")
    for proxy in args.trusted_proxy:
        try:
            ipaddress.ip_network(proxy)
        except ValueError:
            parser.error(f"--trusted-proxy {proxy}: not an IP address or network (such as 127.0.0.1 or 10.0.0.0/8)")
    if not args.api_key and not is_loopback(args.host):
        parser.error(f"--host {args.host} listens beyond this machine: give --api-key (or ${KEYS_VARIABLE}) so that "
                     f"not everyone who can reach it can use it")
    return args


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def main(argv=None) -> None:
    args = parse_args(argv)
    with value_errors_exit():
        model, tokenizer = load_model_and_tokenizer(args.model)
        # A Hugging Face folder's own chat format, if it has one; else ch05's instruction template
        chat_template = ChatTemplate.from_hf(args.model, tokenizer) if Path(args.model).is_dir() else None
        model = model.to(device=args.device, dtype=DTYPES[args.dtype]).eval()
        engine = Engine(model, tokenizer, max_slots=args.max_slots, max_waiting=args.max_waiting,
                        batch_shape=args.batch_shape, max_model_len=args.max_model_len,
                        kv_memory=None if args.kv_memory is None else int(args.kv_memory * 2**30),
                        prefill_chunk=args.prefill_chunk, prefix_sharing=not args.no_prefix_sharing)
    name = args.name or args.name_default
    app = create_app(engine, model_name=name, api_keys=args.api_key, requests_per_minute=args.rate_limit,
                     chat_template=chat_template, hosts=[args.host], max_body_bytes=int(args.max_body_mib * 2**20),
                     read_timeout=args.read_timeout)
    keys = f"{len(args.api_key)} API key(s)" if args.api_key else "no API key"
    chat = "its own chat template" if chat_template else "the instruction template"
    print(f"serving {name} ({model.num_params() / 1e6:.1f}M parameters, {precision(model, args.dtype)}, "
          f"{args.device}; {engine.cache_description}; {keys}; {chat}) at http://{args.host}:{args.port}/  (torch threads: "
          f"{torch.get_num_threads()})", flush=True)
    make_server(app, args.host, args.port, trusted_proxies=args.trusted_proxy, read_timeout=args.read_timeout,
                shutdown_grace=args.shutdown_grace).run()


def precision(model, dtype: str) -> str:
    """What the weights are: "float32", or a quantized model's scheme ("int4 weights (group 64, int8 head), the rest
    float32")."""
    quantization = getattr(model, "quantization", None)
    return dtype if not quantization else f"{describe(quantization)}, the rest {dtype}"

if __name__ == "__main__":
    run_script(main)
