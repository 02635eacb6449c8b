"""The package's C kernels: built once with the machine's C compiler, loaded with ctypes.

The source files live in ``llmscratch/kernels/``. The first use compiles one into a shared library
under ``~/.cache/llmscratch/kernels/`` (or ``$XDG_CACHE_HOME``), named by a hash of the source, the
compiler, its flags and the CPU, so an edit, another compiler or another machine builds afresh; later
processes load the file. It is built for the CPU it runs on (``-march=native``) and with OpenMP, where
the compiler takes them (each flag set tried in turn; a library built before, with any of them, is
loaded first). ``$CC`` may hold flags (``CC="ccache gcc"``).

The cache is not trusted: a library is written atomically with its sha256 beside it, and loaded only
when the two agree (a truncated file would kill the process with SIGBUS inside ``dlopen``); the caller's
``check`` then compares a small computation with PyTorch's. A library that fails either is deleted and
built again. A build that fails with every flag set (or a compiler that hangs) is remembered for
``FAILURE_SECONDS`` in a ``.failed`` file beside them, so that other processes do not pay for it again.
Where no library can be had, ``load`` warns once, saying why, and returns None; with
``LLMSCRATCH_NO_NATIVE=1`` set it returns None silently. The callers then use their PyTorch paths.
"""

import _ctypes
import ctypes
import functools
import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from llmscratch.files import remove_stale_temporaries, write_atomically, write_text_atomically

SOURCES = Path(__file__).parent / "kernels"
# The flags tried in turn: this CPU's instructions and OpenMP's threads, then without one or both (Apple's clang
# has no OpenMP; some compilers spell -march=native otherwise).
FLAG_SETS = (["-O3", "-march=native", "-fopenmp"], ["-O3", "-march=native"], ["-O3", "-fopenmp"], ["-O3"])
COMPILE_SECONDS = 120
FAILURE_SECONDS = 3600  # how long a failed build is remembered: a compiler fixed meanwhile waits at most an hour


class KernelCheckError(Exception):
    """A loaded library computes otherwise than the caller's check expects."""


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


def _compiler(name: str) -> list[str] | None:
    """The compiler's command line: ``$CC`` split as a shell would, else the first of cc, gcc, clang found.

    A ``$CC`` whose program is not found is said, naming it, rather than passed over in silence.
    """
    wanted = os.environ.get("CC", "").strip()
    if wanted:
        try:
            command = shlex.split(wanted)
        except ValueError:  # an unmatched quote
            command = []
        if command and shutil.which(command[0]):
            return command
    fallback = next(([c] for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if wanted and fallback:  # (with none, load says so)
        warnings.warn(f"$CC={wanted!r} does not name a program found on PATH: building {name} with {fallback[0]} "
                      f"instead", stacklevel=3)
    return fallback


@functools.cache
def load(name: str, check: Callable[[ctypes.CDLL], None] | None = None) -> ctypes.CDLL | None:
    """The shared library built from ``kernels/<name>.c``, or None (warned once) where it cannot be had.

    check: called with the loaded library; it raises (any exception) where the library computes wrong,
    which then counts as a damaged file: deleted and built again.
    """
    if os.environ.get("LLMSCRATCH_NO_NATIVE") == "1":
        return None
    source = SOURCES / f"{name}.c"
    compiler = _compiler(name)
    if compiler is None:
        tried = f"$CC={os.environ['CC']!r}" if os.environ.get("CC", "").strip() else "$CC"
        warnings.warn(f"no C compiler found (tried {tried}, cc, gcc, clang): {name} runs in PyTorch instead",
                      stacklevel=2)
        return None
    text, cpu = source.read_text(), _cpu_description()
    failed = cache_dir() / f"{name}-{_key(text, compiler, [], cpu)}.failed"
    remembered = _remembered_failure(failed)
    if remembered:
        warnings.warn(f"the C kernel {source} failed to build {remembered}; not tried again before "
                      f"{FAILURE_SECONDS // 60} minutes have passed (delete {failed} to try now): it runs in PyTorch "
                      f"instead", stacklevel=2)
        return None
    libraries = [(flags, cache_dir() / f"{name}-{_key(text, compiler, flags, cpu)}.so") for flags in FLAG_SETS]
    # libraries built before come first, so that no process repeats a compile that failed for another
    libraries.sort(key=lambda pair: not pair[1].exists())
    rebuilt, errors = [], []
    for flags, library in libraries:
        try:
            loaded = _load_or_build(compiler, flags, source, library, check, rebuilt)
        except subprocess.TimeoutExpired as err:  # a compiler that hangs hangs with any flags: try no more
            errors.append(f"{shlex.join(compiler)} did not finish within {err.timeout:.0f} s")
            break
        except (OSError, subprocess.SubprocessError, KernelCheckError) as err:
            errors.append(f"{shlex.join(compiler + flags)}: {err}")
            continue
        if rebuilt:
            warnings.warn(f"{'; '.join(rebuilt)}: deleted and built again", stacklevel=2)
        return loaded
    error = "; ".join(rebuilt + errors)[-1500:]
    _remember_failure(failed, error)
    warnings.warn(f"could not build the C kernel {source} ({error}): it runs in PyTorch instead (not tried again "
                  f"for {FAILURE_SECONDS // 60} minutes; delete {failed} to try sooner)", stacklevel=2)
    return None


def _load_or_build(compiler: list[str], flags: list[str], source: Path, library: Path,
                   check: Callable[[ctypes.CDLL], None] | None, rebuilt: list[str]) -> ctypes.CDLL:
    """The library at ``library``, verified; built (again) if it is missing or fails; raises if the new one fails."""
    if library.exists():
        problem = _checksum_problem(library)  # before dlopen: a truncated file is a SIGBUS, not an exception
        if problem is None:
            loaded = ctypes.CDLL(str(library))
            problem = _check_problem(loaded, check)
            if problem is None:
                return loaded
        rebuilt.append(f"{library} {problem}")
        _remove(library)
    remove_stale_temporaries(library)  # what builds killed midway left
    write_atomically(library, lambda tmp: _build(compiler, flags, source, tmp, library))
    loaded = ctypes.CDLL(str(library))
    problem = _check_problem(loaded, check)
    if problem is not None:
        _remove(library)
        raise KernelCheckError(f"built afresh, it {problem}")
    return loaded


def _build(compiler: list[str], flags: list[str], source: Path, tmp: str, library: Path) -> None:
    """Compile into ``tmp`` and record its sha256 beside ``library``, before the library is renamed into place:
    a process that sees the new library sees its checksum too."""
    _compile(compiler, flags, source, tmp)
    write_text_atomically(_checksum_file(library), _sha256(Path(tmp)))


def _checksum_file(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _checksum_problem(library: Path) -> str | None:
    """What is wrong with ``library`` against the sha256 recorded when it was built, or None."""
    if not library.is_file():
        return "is not a file"
    try:
        recorded = _checksum_file(library).read_text().strip()
    except OSError:
        return "has no checksum recorded at its build"
    if _sha256(library) != recorded:
        return "does not match the checksum recorded at its build (damaged or replaced)"
    return None


def _check_problem(loaded: ctypes.CDLL, check: Callable[[ctypes.CDLL], None] | None) -> str | None:
    """Run the caller's known-answer check; what went wrong (the library then unloaded), or None."""
    if check is None:
        return None
    try:
        check(loaded)
    except Exception as err:  # any failure of the check (a wrong answer, a missing symbol) refuses the library
        _ctypes.dlclose(loaded._handle)  # so that loading the rebuilt file at this path maps it anew
        return f"fails its known-answer check ({type(err).__name__}: {err})"
    return None


def _remove(library: Path) -> None:
    if library.is_dir() and not library.is_symlink():  # a folder where the library belongs
        shutil.rmtree(library)
    library.unlink(missing_ok=True)
    _checksum_file(library).unlink(missing_ok=True)


def _remembered_failure(failed: Path) -> str | None:
    """'<when> (<error>)' of a failed build recorded less than FAILURE_SECONDS ago, else None."""
    try:
        record = json.loads(failed.read_text())
        at, error = float(record["time"]), str(record["error"])
    except (OSError, ValueError, KeyError, TypeError):  # none, or not one we wrote: build
        return None
    if not 0 <= time.time() - at < FAILURE_SECONDS:
        return None
    return f"at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(at))} ({error})"


def _remember_failure(failed: Path, error: str) -> None:
    try:
        write_text_atomically(failed, json.dumps({"time": time.time(), "error": error}) + "\n")
    except OSError:
        pass  # a cache that cannot be written: the next process tries again, nothing worse


def _key(source_text: str, compiler: list[str], flags: list[str], cpu: str) -> str:
    return hashlib.sha256("|".join([source_text, shlex.join(compiler), " ".join(flags), cpu]).encode()).hexdigest()[:16]


def _compile(compiler: list[str], flags: list[str], source: Path, out: str) -> None:
    # A session of its own, so that a compiler that hangs is killed with everything it started.
    with subprocess.Popen([*compiler, *flags, "-shared", "-fPIC", str(source), "-o", out], start_new_session=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        try:
            _, stderr = process.communicate(timeout=COMPILE_SECONDS)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)  # leaving the block then closes the pipes and reaps it
            raise
    if process.returncode:
        raise subprocess.SubprocessError(stderr.strip()[-1000:] or f"exit status {process.returncode}")
