"""The package's C kernels: built once with the machine's C compiler, loaded with ctypes.

The source files live in ``llmscratch/kernels/``. The first use compiles one into a shared library
under ``~/.cache/llmscratch/kernels/`` (or ``$XDG_CACHE_HOME``), named by a hash of the source, the
compiler, its flags and the CPU, so an edit, another compiler or another machine builds afresh; later
processes load the file. It is built for the CPU it runs on (``-march=native``) and with OpenMP, where
the compiler takes them (each flag set tried in turn; a library built before, with any of them, is
loaded first). Where no compiler works, ``load`` warns once, saying why, and returns None; with
``LLMSCRATCH_NO_NATIVE=1`` set it returns None silently. The callers then use their PyTorch paths.
"""

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from pathlib import Path

from llmscratch.files import write_atomically

SOURCES = Path(__file__).parent / "kernels"
# The flags tried in turn: this CPU's instructions and OpenMP's threads, then without one or both (Apple's clang
# has no OpenMP; some compilers spell -march=native otherwise).
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3", "-fopenmp"], ["-O3"])
COMPILE_SECONDS = 120


def cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "llmscratch" / "kernels"


def _cpu_description() -> str:
    """What -march=native depends on: the machine and, on Linux, the CPU's model and feature flags."""
    lines = []
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            lines = [line for line in cpuinfo if line.startswith(("model name", "flags", "Features"))][:3]
    except OSError:
        pass
    return platform.machine() + platform.processor() + "".join(lines)


def _compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)


@functools.cache
def load(name: str) -> ctypes.CDLL | None:
    """The shared library built from ``kernels/<name>.c``, or None (warned once) where it cannot be built."""
    if os.environ.get("LLMSCRATCH_NO_NATIVE") == "1":
        return None
    source = SOURCES / f"{name}.c"
    compiler = _compiler()
    if compiler is None:
        warnings.warn(f"no C compiler found (tried $CC, cc, gcc, clang): {name} runs in PyTorch instead", stacklevel=2)
        return None
    text, cpu = source.read_text(), _cpu_description()
    libraries = [(flags, cache_dir() / f"{name}-{_key(text, compiler, flags, cpu)}.so") for flags in FLAG_SETS]
    # libraries built before come first, so that no process repeats a compile that failed for another
    libraries.sort(key=lambda pair: not pair[1].exists())
    errors = []
    for flags, library in libraries:
        if not library.exists():
            try:
                write_atomically(library, lambda tmp, flags=flags: _compile(compiler, flags, source, tmp))
            except (OSError, subprocess.SubprocessError) as err:
                errors.append(f"{compiler} {' '.join(flags)}: {err}")
                continue
        try:
            return ctypes.CDLL(str(library))
        except OSError as err:
            errors.append(f"loading {library}: {err}")
    warnings.warn(f"could not build the C kernel {source} ({'; '.join(errors)[-1500:]}): it runs in PyTorch "
                  f"instead", stacklevel=2)
    return None


def _key(source_text: str, compiler: str, flags: list[str], cpu: str) -> str:
    return hashlib.sha256("|".join([source_text, compiler, " ".join(flags), cpu]).encode()).hexdigest()[:16]


def _compile(compiler: str, flags: list[str], source: Path, out: str) -> None:
    done = subprocess.run([compiler, *flags, "-shared", "-fPIC", str(source), "-o", out],
                          capture_output=True, text=True, timeout=COMPILE_SECONDS)
    if done.returncode:
        raise subprocess.SubprocessError(done.stderr.strip()[-1000:] or f"exit status {done.returncode}")
