"""What keeps a reader's answer from moving the goalposts of its own check, or from holding it up forever.

An answer runs in the same process as the references it is compared with. It could replace a
package function (``llmscratch.model.attention.causal_mask = ...``) or method (``GPT.forward = ...``),
turn off gradients, change the default dtype, or never return. ``PACKAGE`` remembers the package
as the exercises loaded it and puts it back; ``TorchSwitches`` does the same for torch's global
switches; ``time_limited`` stops a check that runs too long. ``checking`` uses all three around
each check, and the first two again after each call of the answer. ``forbidden`` takes away, while a
"write it yourself" answer runs, the library functions it is meant to rebuild (``F.cross_entropy``,
``GPT.num_params``).
"""

import contextlib
import functools
import importlib
import signal
import sys
import threading
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["PACKAGE", "TIME_LIMIT", "ForbiddenCall", "Namespaces", "TimeLimitExceeded", "TorchSwitches", "forbidden",
           "package_as_loaded", "resolve", "shown", "time_limited", "too_slow"]

# Seconds for one exercise's check (and for loading an answers file). On a 2-core machine the
# slowest worked answer takes 0.7 to 1.6 s idle (ch01's encode_with_dropout; most take under 0.3 s),
# 7 s loaded three times over (ch05's fit_early_stopping): a right answer written plainly, or a busy
# machine, stays well inside; an endless loop is named within a minute.
TIME_LIMIT = 60.0


class Namespaces:
    """The attributes of llmscratch's modules and of the classes they define, saved to be put back."""

    def __init__(self, saved: dict[Any, dict[str, Any]] | None = None):
        self.saved = saved if saved is not None else {}  # module or class -> its attributes

    def add_loaded(self) -> None:
        """Also save the llmscratch modules loaded since (with their classes), as they are now."""
        for name, module in list(sys.modules.items()):
            if (name == "llmscratch" or name.startswith("llmscratch.")) and isinstance(module, types.ModuleType) \
                    and module not in self.saved:
                self.saved[module] = dict(vars(module))
                for value in list(vars(module).values()):
                    if isinstance(value, type) and value.__module__ == name:
                        self.saved.setdefault(value, dict(vars(value)))

    def now(self) -> "Namespaces":
        """The same modules and classes, saved as they are now."""
        return Namespaces({owner: dict(vars(owner)) for owner in self.saved})

    def restore(self) -> None:
        """Put back each saved attribute that was replaced or deleted (added ones stay: nothing saved reads them)."""
        for owner, saved in self.saved.items():
            current = vars(owner)
            for key, value in saved.items():
                if current.get(key, _ABSENT) is not value:
                    setattr(owner, key, value)


_ABSENT = object()  # what no attribute holds
PACKAGE = Namespaces()  # the package as the exercises loaded it (each Chapter adds what its module imported)


@dataclass(frozen=True)
class TorchSwitches:
    """torch's global switches an answer may flip; torch's defaults unless taken ``now``."""

    grad_enabled: bool = True
    default_dtype: torch.dtype = torch.float32
    default_device: torch.device = torch.device("cpu")
    matmul_precision: str = "highest"
    deterministic: tuple[bool, bool] = (False, False)  # deterministic algorithms on, and warn only

    @classmethod
    def now(cls) -> "TorchSwitches":
        return cls(torch.is_grad_enabled(), torch.get_default_dtype(), torch.get_default_device(),
                   torch.get_float32_matmul_precision(), _deterministic())

    def restore(self) -> None:
        torch.set_grad_enabled(self.grad_enabled)
        torch.set_default_dtype(self.default_dtype)
        if torch.get_default_device() != self.default_device:  # setting one slows every later call: on change only
            torch.set_default_device(None if self.default_device == torch.device("cpu") else self.default_device)
        torch.set_float32_matmul_precision(self.matmul_precision)
        if _deterministic() != self.deterministic:
            torch.use_deterministic_algorithms(self.deterministic[0], warn_only=self.deterministic[1])


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


@contextlib.contextmanager
def package_as_loaded() -> Iterator[None]:
    """Inside: the package as the exercises loaded it, under torch's default switches. After: the reader's again."""
    readers_package, readers_switches = PACKAGE.now(), TorchSwitches.now()
    PACKAGE.restore()
    TorchSwitches().restore()
    try:
        yield
    finally:
        readers_package.restore()
        readers_switches.restore()


class TimeLimitExceeded(BaseException):
    """A check ran past its time limit: a BaseException, so that an answer's ``except Exception`` lets it through."""


def too_slow(seconds: float) -> str:
    """What a verdict says of a check stopped at its time limit."""
    return f"did not finish within {seconds:g} s (an endless loop?)"


@contextlib.contextmanager
def time_limited(seconds: float | None) -> Iterator[None]:
    """Raise TimeLimitExceeded in whatever runs ``seconds`` into the block (None: no limit).

    A SIGALRM timer: only on the main thread of a platform that has one (Linux, macOS: a notebook's
    kernel), and not while another timer is set, which ours would cancel. Elsewhere, no limit; nor
    can it stop an answer that catches every exception (a bare ``except:``) in a loop. The command
    line, which runs the answers in a process it can kill, has no such gaps.
    """
    if (seconds is None or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread()
            or signal.getitimer(signal.ITIMER_REAL)[0] > 0):
        yield
        return

    def expire(signum, frame):
        raise TimeLimitExceeded

    previous = signal.signal(signal.SIGALRM, expire)
    try:
        signal.setitimer(signal.ITIMER_REAL, seconds)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)


class ForbiddenCall(BaseException):
    """An answer called a function its exercise asks it to write: a BaseException, past an ``except Exception``."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


def shown(path: str) -> str:
    """A forbidden function's dotted path as a reader writes it: ``F.cross_entropy``, ``GPT.num_params``."""
    if path.startswith("torch.nn.functional."):
        return "F." + path.removeprefix("torch.nn.functional.")
    if path.startswith("llmscratch."):
        called = "(...)" if path.endswith("(...)") else ""  # a class whose construction is forbidden
        owner, name = resolve(path.removesuffix(called))  # llmscratch.model.gpt.GPT.num_params: GPT.num_params
        return (f"{owner.__qualname__}.{name}" if isinstance(owner, type) else name) + called
    return path


def resolve(path: str) -> tuple[Any, str]:
    """The owner (module or class) of the attribute a dotted path names, and the attribute's name."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:-1]:
            owner = getattr(owner, part)
        return owner, parts[-1]
    raise ValueError(f"{path!r} names no attribute of an importable module")


@contextlib.contextmanager
def forbidden(paths: tuple[str, ...], answer: Any) -> Iterator[None]:
    """Inside: each function in ``paths`` raises ForbiddenCall however the answer reaches it. After: all as before.

    A function is taken away in itself (its code swapped), so a name bound to it anywhere raises too: an
    import of it, a default argument, a closure, a ``functools.partial``, a dict of functions. A class
    raises when built; one of torch's builtins (``F.scaled_dot_product_attention``) when torch dispatches it.
    """
    undo, builtins = [], {}
    namespace = getattr(getattr(answer, "__func__", answer), "__globals__", None)
    try:
        for path in paths:
            owner, name = resolve(path)
            original = getattr(owner, name)
            if answer is original:  # the library's own function given as the answer: no patch reaches that call
                raise ForbiddenCall(path)
            function = getattr(original, "__func__", original)  # a classmethod's function
            if isinstance(original, type):  # a class: take away its construction, wherever it is named
                undo.append((original, "__init__", vars(original).get("__init__", _ABSENT)))
                original.__init__ = _raiser(path + "(...)")
            elif isinstance(function, types.FunctionType):
                undo += [(function, key, getattr(function, key)) for key in ("__code__", "__defaults__",
                                                                             "__kwdefaults__")]
                function.__code__ = _raiser_code(len(function.__code__.co_freevars))
                function.__defaults__, function.__kwdefaults__ = None, {"forbidden_call": _raiser(path)}
            else:  # a builtin: replaced where it is named, and refused by identity wherever else it is reached
                builtins[original] = path
                undo.append((owner, name, vars(owner).get(name, _ABSENT)))
                setattr(owner, name, _raiser(path))
                for key, value in list(namespace.items()) if namespace is not None else []:
                    if value is original:
                        undo.append((namespace, key, value))
                        namespace[key] = _raiser(path)
        with _Refused(builtins) if builtins else contextlib.nullcontext():
            yield
    finally:
        for owner, name, value in reversed(undo):
            if isinstance(owner, dict):
                owner[name] = value
            elif value is _ABSENT:
                delattr(owner, name)
            else:
                setattr(owner, name, value)


class _Refused(TorchFunctionMode):
    """Raise ForbiddenCall when torch dispatches one of the given builtins, however the caller reached it."""

    def __init__(self, paths: dict[Any, str]):
        super().__init__()
        self.paths = paths  # the builtin -> its dotted path

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (path := self.paths.get(func)) is not None:
            raise ForbiddenCall(path)
        return func(*args, **(kwargs or {}))


@functools.cache
def _raiser_code(n_free: int) -> types.CodeType:
    """Code that calls its keyword default ``forbidden_call``: a function's own, given ``n_free`` closure cells

    as its code had (CPython swaps a function's code only for code of as many).
    """
    names = [f"cell{i}" for i in range(n_free)]
    source = ("def outer():\n" + "".join(f"    {name} = None\n" for name in names)
              + "    def forbidden(*args, forbidden_call=None, **kwargs):\n"
              + (f"        {', '.join(names)}\n" if names else "") + "        forbidden_call()\n"
              + "    return forbidden\n")
    scope: dict = {}
    exec(source, scope)
    return scope["outer"]().__code__


def _raiser(path: str):
    def forbidden_call(*args, **kwargs):
        raise ForbiddenCall(path)
    return forbidden_call
