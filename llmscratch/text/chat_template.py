"""A Hugging Face model's chat template: the Jinja text in its folder that lays a conversation out in the
tokens the model was tuned on (Qwen3's ChatML ``<|im_start|>user ... <|im_end|>``, for instance), so that
the server's /v1/chat/completions talks to such a model in its own format.

The template is rendered in Jinja's sandbox, with what transformers gives it (the messages,
``add_generation_prompt``, the special tokens the folder names, ``raise_exception``, ``strftime_now``, a
``tojson`` filter), and encoded as transformers encodes it. What a user wrote never becomes a special
token: a message that contains one (say "<|im_end|>", which would end its turn and let it write the
next) is refused with its name.

A template is a program that came with a download, and the sandbox bounds what it may touch, not what it
costs: ``{{ 'x' * 10**10 }}``, loops within loops or a macro that calls itself would take the memory, the
time or the stack of the process that renders it. So it is rendered in a small worker process (this file,
run with only the standard library and jinja2), with an address-space limit, a time limit (past it the
worker is killed and another started) and a limit on what it writes; each overrun is a ValueError naming
the template and the limit.
"""

import atexit
import datetime
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["ChatTemplate"]

SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
SECONDS = 5.0  # one render's time limit
MAX_CHARS = 1 << 24  # the longest text a render may write (16M characters, more than any model's context)
MEMORY_BYTES = 1 << 30  # a worker's address space
MAX_WORKERS = 4  # worker processes kept for the threads that render at once (the server's)
_STARTUP_SECONDS = 60.0  # for a fresh worker to import jinja2 on a busy machine


@dataclass
class ChatTemplate:
    """source: the Jinja text. tokens: the special tokens it may use by name (bos_token, eos_token, ...).
    stops: the texts that end the model's answer (the folder's eos_token, and the tokens its
    generation_config.json ends on: Gemma's "<end_of_turn>"). origin: the file it came from, which errors name.
    seconds, max_chars: a render's limits."""

    source: str
    tokens: dict[str, str] = field(default_factory=dict)
    stops: tuple[str, ...] = ()
    origin: str = ""
    seconds: float = SECONDS
    max_chars: int = MAX_CHARS

    @classmethod
    def from_hf(cls, folder: str | os.PathLike, tokenizer=None) -> "ChatTemplate | None":
        """The template of a Hugging Face folder (chat_template.jinja, else tokenizer_config.json's
        "chat_template"), or None if it has none; a malformed file is a ValueError naming it. With the
        folder's tokenizer, the ids generation_config.json ends on are stops too."""
        # Imported here: the worker runs this file with the standard library and jinja2 alone.
        from llmscratch.files import read_json_object
        from llmscratch.text.checks import check_tokenizer_config

        folder = Path(folder)
        config_file = origin = folder / "tokenizer_config.json"
        config = read_json_object(config_file) if config_file.is_file() else {}
        check_tokenizer_config(config, config_file)
        source = config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():  # where transformers 4.50 and later save it
            origin = folder / "chat_template.jinja"
            try:
                source = origin.read_text(encoding="utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{origin} is not UTF-8 text ({err})") from None
        if isinstance(source, list):  # several named templates: the default one
            source = {entry.get("name"): entry["template"] for entry in source}.get("default")
        if source is None:
            return None
        tokens = {key: _token_text(config[key]) for key in SPECIAL_KEYS if config.get(key) is not None}
        stops = [tokens["eos_token"]] if "eos_token" in tokens else []
        generation_file = folder / "generation_config.json"
        if tokenizer is not None and generation_file.is_file():
            ends = read_json_object(generation_file).get("eos_token_id")
            for token_id in ends if isinstance(ends, list) else [] if ends is None else [ends]:
                if isinstance(token_id, int) and 0 <= token_id < tokenizer.vocab_size:
                    stops.append(tokenizer.decode([token_id]))
        template = cls(source, tokens, tuple(dict.fromkeys(stop for stop in stops if stop)), str(origin))
        template._ask({"source": source})  # a template that does not parse is named now, not at the first request
        return template

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the model reads it (text, special tokens written out)."""
        return self._ask({"source": self.source, "messages": list(messages), "tokens": self.tokens,
                          "add_generation_prompt": add_generation_prompt, "max_chars": self.max_chars})

    def encode(self, messages: Sequence[dict], tokenizer, add_generation_prompt: bool = True) -> list[int]:
        """The token ids of ``render``, its special tokens as such; a message whose content holds one of the
        tokenizer's special tokens is a ValueError naming it (it could end its turn and forge another)."""
        for index, message in enumerate(messages):
            content = message.get("content")
            found = [token for token in tokenizer.special_tokens
                     if token not in getattr(tokenizer, "added_text", ()) and isinstance(content, str)
                     and token in content]
            if found:
                first = min(found, key=content.index)
                raise ValueError(f"message {index} contains the special token {first!r}, which only the chat "
                                 "template may write")
        return tokenizer.encode(self.render(messages, add_generation_prompt), allowed_special="all")

    def _ask(self, request: dict) -> str:
        """What a worker answers to ``request``; its error, or an overrun, as a one-line ValueError."""
        try:
            line = json.dumps({**request, "seconds": self.seconds}).encode() + b"\n"
        except (TypeError, ValueError) as err:
            answer = {"error": f"the conversation is not JSON data ({err})"}
        else:
            answer = _WORKERS.ask(line, self.seconds)
        if "text" in answer:
            return answer["text"]
        message = " ".join(answer["error"].split())[:500]  # one line, whatever the template raised
        raise ValueError(f"{self.origin}: {message}" if self.origin else message)


def _token_text(value) -> str:
    """A special token as tokenizer_config.json writes it: the text, or an object with its "content"."""
    return value["content"] if isinstance(value, dict) else value


# --------------------------------------------------------------------------- the workers (the parent's side)
class _Worker:
    """One worker process: a request (a JSON line) on its stdin, the answer (a JSON line) on its stdout."""

    def __init__(self):
        self.process = subprocess.Popen([sys.executable, "-I", __file__, str(MEMORY_BYTES), str(os.getpid())],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        if self._read(_STARTUP_SECONDS) != b'"ready"\n':
            self.stop()
            raise ValueError(f"the chat template's worker did not start ({sys.executable} -I {__file__}: is "
                             "jinja2 installed?)")

    def ask(self, line: bytes, seconds: float) -> dict:
        """The worker's answer, or an error naming the limit it overran (the caller then stops it)."""
        try:
            self.process.stdin.write(line)
            self.process.stdin.flush()
        except OSError:  # it died on the last request, after answering
            return {"error": "the chat template's worker stopped; try again", "failed": True}
        answer = self._read(seconds)
        if answer is None:
            return {"error": f"the chat template ran past its time limit of {seconds:g} s", "failed": True}
        if not answer:
            code = self.process.wait()
            return {"error": f"the chat template stopped its worker (exit status {code}): out of memory, time or "
                             "stack", "failed": True}
        return json.loads(answer)

    def _read(self, seconds: float) -> bytes | None:
        """One line from the worker; b"" if it died, None if none came within ``seconds``."""
        deadline, chunks, fd = time.monotonic() + seconds, [], self.process.stdout.fileno()
        waiting = select.poll()  # not select.select, which fails on a descriptor past 1023 (a busy server's)
        waiting.register(fd, select.POLLIN)
        while not chunks or not chunks[-1].endswith(b"\n"):
            if not waiting.poll(max(deadline - time.monotonic(), 0) * 1000):
                return None
            chunks.append(os.read(fd, 1 << 20))
            if not chunks[-1]:
                return b""
        return b"".join(chunks)

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        for pipe in (self.process.stdin, self.process.stdout):
            try:
                pipe.close()
            except OSError:  # a request it never read, which close would flush again
                pass


class _Workers:
    """Up to ``MAX_WORKERS`` workers, each used by one thread at a time; one that overran is stopped."""

    def __init__(self):
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._running = 0
        self._free = threading.Condition()
        self._pid = os.getpid()

    def ask(self, line: bytes, seconds: float) -> dict:
        if self._pid != os.getpid():  # a forked child (a DataLoader's worker): the parent's workers are not ours
            self.__init__()
        with self._free:
            while not self._idle and self._running >= MAX_WORKERS:
                self._free.wait()
            worker = self._idle.pop() if self._idle else None
            self._running += worker is None
        answer = {"failed": True}
        try:
            worker = worker or _Worker()
            with self._free:
                self._busy.add(worker)
            answer = worker.ask(line, seconds)
            return answer
        finally:
            with self._free:
                self._busy.discard(worker)
                failed = answer.get("failed")
                self._running -= bool(failed)
                if not failed:
                    self._idle.append(worker)
                self._free.notify()
            if failed and worker is not None:
                worker.stop()

    def stop(self) -> None:
        """Stop every worker, the busy ones too (at exit: a render that runs on must not outlive us)."""
        if self._pid != os.getpid():  # a forked child exiting: the workers are its parent's
            return
        with self._free:
            idle, busy, self._idle = self._idle, list(self._busy), []
        for worker in idle:
            worker.stop()
        for worker in busy:
            worker.process.kill()  # its thread's ``ask`` sees it end, and stops it


_WORKERS = _Workers()
atexit.register(_WORKERS.stop)


# --------------------------------------------------------------------------- the worker (its own process)
def _serve(memory_bytes: int, parent: int) -> None:
    """Answer requests until stdin closes: compile the template (kept for the next request), then render."""
    import resource
    import signal

    import jinja2.sandbox  # noqa: F401 (loaded before the memory limit, as all of jinja2 that renders)
    from jinja2 import TemplateError

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it closes our stdin
    threading.Thread(target=_exit_with, args=(parent,), daemon=True).start()
    resource.setrlimit(resource.RLIMIT_AS, (memory_bytes, memory_bytes))
    compiled = {}
    _reply("ready")
    for line in sys.stdin.buffer:
        request = json.loads(line)
        # A second bound on time, should the parent be gone: the kernel stops a render that runs on.
        usage, hard = resource.getrusage(resource.RUSAGE_SELF), resource.getrlimit(resource.RLIMIT_CPU)[1]
        soft = int(usage.ru_utime + usage.ru_stime + 2 * request["seconds"]) + 2
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            if request["source"] not in compiled:
                if len(compiled) > 16:
                    compiled.clear()
                compiled[request["source"]] = _compile(request["source"])
            if "messages" in request:
                _reply({"text": _render(compiled[request["source"]], request)})
            else:
                _reply({"text": ""})
        except _Refused as err:
            _reply({"error": f"the chat template refused the conversation: {err}"})
        except _TooLong as err:
            _reply({"error": str(err)})
        except TemplateError as err:
            failure = "is not valid Jinja" if request["source"] not in compiled else "failed on this conversation"
            _reply({"error": f"the chat template {failure}: {err}"})
        except MemoryError:
            _reply({"error": f"the chat template needed more than its {memory_bytes >> 20} MiB of memory"})
        except RecursionError:
            _reply({"error": "the chat template recursed or nested too deeply (a macro that calls itself, or blocks "
                             "and brackets thousands deep)"})
        except Exception as err:  # noqa: BLE001 (the template's own error, whatever it is, goes back as text)
            _reply({"error": f"the chat template failed on this conversation: {type(err).__name__}: {err}"})


def _exit_with(parent: int) -> None:
    """End this worker once its parent is gone, even in the middle of a render (the parent kills a worker that
    overruns; a parent killed itself cannot)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


class _Refused(Exception):
    """What the template's ``raise_exception`` raises."""


class _TooLong(Exception):
    """A render that wrote more than its ``max_chars``."""


def _compile(source: str):
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %}...{% endgeneration %}``, which transformers' templates use to mark the assistant's
        part for training masks: here it renders what it holds, as transformers does."""

        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise _Refused(message)

    def tojson(value, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols", Generation])
    environment.filters["tojson"] = tojson
    environment.globals.update(raise_exception=raise_exception,
                               strftime_now=lambda fmt: datetime.datetime.now().strftime(fmt))
    return environment.from_string(source)


def _render(template, request: dict) -> str:
    """The template's text, written piece by piece so that a long one stops at ``max_chars``."""
    pieces, length = [], 0
    for piece in template.generate(messages=request["messages"], add_generation_prompt=request["add_generation_prompt"],
                                   **request["tokens"]):
        length += len(piece)
        if length > request["max_chars"]:
            raise _TooLong(f"the chat template wrote more than {request['max_chars']:,} characters")
        pieces.append(piece)
    return "".join(pieces)


def _reply(answer) -> None:
    sys.stdout.buffer.write(json.dumps(answer).encode() + b"\n")
    sys.stdout.buffer.flush()


if __name__ == "__main__":
    _serve(int(sys.argv[1]), int(sys.argv[2]))
