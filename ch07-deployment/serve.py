"""Serve a model over HTTP: an OpenAI-compatible API with continuous batching, and a chat page.

    python ch07-deployment/serve.py                          # the bundled base model, http://127.0.0.1:8000
    python ch07-deployment/serve.py --model instructions     # ch05's instruction follower (chat page at /)
    python ch07-deployment/serve.py --model dpo --host 0.0.0.0 --port 8080 --api-key "$KEY"
    python ch07-deployment/serve.py --model ~/models/Qwen3-0.6B       # a Hugging Face folder, in its chat format

Then open http://127.0.0.1:8000/ in a browser, or talk to it with curl or the official openai
client (base_url "http://127.0.0.1:8000/v1"); docs/serving.md shows both. Endpoints: /v1/completions,
/v1/chat/completions (streamed with "stream": true), /v1/models, /health, /metrics.

API keys come from --api-key (repeatable) and from the environment variable LLMSCRATCH_API_KEYS
(comma-separated). With none the server answers anyone who can reach it, so it then listens on
127.0.0.1 only: another --host needs a key.
"""

import argparse
import ipaddress
import os
from pathlib import Path

import torch
import uvicorn

from llmscratch.cli import check_device, resolve_model, run_script, value_errors_exit
from llmscratch.deployment.engine import BATCH_SHAPES, Engine
from llmscratch.deployment.server import create_app
from llmscratch.device import DTYPES
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
    add("--max-slots", type=int, default=16, help="sequences decoded together, one KV-cache row each (default 16)")
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
                        ("--rate-limit", args.rate_limit)):
        if value is not None and value < 1:
            parser.error(f"{flag} must be at least 1, got {value}")
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
                    batch_shape=args.batch_shape)
    name = args.name or args.name_default
    app = create_app(engine, model_name=name, api_keys=args.api_key, requests_per_minute=args.rate_limit,
                     chat_template=chat_template)
    keys = f"{len(args.api_key)} API key(s)" if args.api_key else "no API key"
    chat = "its own chat template" if chat_template else "the instruction template"
    print(f"serving {name} ({model.num_params() / 1e6:.1f}M parameters, {args.dtype}, {args.device}; {keys}; {chat}) "
          f"at http://{args.host}:{args.port}/  (torch threads: {torch.get_num_threads()})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    run_script(main)
