"""Command-line interface: a thin Typer shell over the library (see `pgdiag.cli.app`)."""

from __future__ import annotations

import atexit
import os
import sys
import threading
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import NoReturn

from pgdiag.errors import Code


def run(args: list[str] | None = None) -> int:
    """Run the `pgdiag` program on `args` (default ``sys.argv[1:]``) and return its exit code.

    A command line Typer cannot parse becomes one ``error[E503]`` (a bad option value) or ``error[E515]``
    (unknown option, missing argument) line with exit 2, not Typer's multi-line box.
    """
    import typer
    from typer._click import exceptions as click_errors  # typer vendors click: what its parser raises

    from pgdiag.cli.app import build_app
    from pgdiag.cli.common import make_console, one_line

    command = typer.main.get_command(build_app())
    try:
        code = command.main(args, prog_name="pgdiag", standalone_mode=False)
    except click_errors.NoArgsIsHelpError as error:
        error.show()
        return error.exit_code
    except click_errors.UsageError as error:
        bad_value = isinstance(error, click_errors.BadParameter) and not isinstance(
            error, click_errors.MissingParameter
        )
        code_name = Code.BAD_OPTION_VALUE if bad_value else Code.BAD_COMMAND_LINE
        console = make_console()
        console.print(f"error[{code_name}] {one_line(error.format_message())}", markup=False, soft_wrap=True)
        console.print("hint: pgdiag COMMAND --help lists the options", markup=False, soft_wrap=True)
        return 2
    return code if isinstance(code, int) else 0


def bytecode_cache(environ: MutableMapping[str, str]) -> Path | None:
    """Keep compiled Python bytecode under ``$XDG_CACHE_HOME/pgdiag/pycache`` (default ``~/.cache/...``) when
    the environment forbids writing it next to the sources (``PYTHONDONTWRITEBYTECODE``) and names no cache of
    its own (``PYTHONPYCACHEPREFIX``); returns that folder, or None when nothing changed.

    Why: container images often set ``PYTHONDONTWRITEBYTECODE=1`` and install torch without bytecode (uv's
    default), so every start compiled torch's Python sources again: ~10 s of each ``pgdiag logprobs`` and of
    each of its workers (docs/benchmarks.md, "Issue 26"). The cache lives outside the installed packages, as
    the flag intends; it applies to this process and, through `environ`, to the workers it starts.
    """
    if not sys.dont_write_bytecode or sys.pycache_prefix or environ.get("PYTHONPYCACHEPREFIX"):
        return None
    root = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pgdiag" / "pycache"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(root, os.W_OK):
        return None
    sys.pycache_prefix = str(root)
    sys.dont_write_bytecode = False
    environ["PYTHONPYCACHEPREFIX"] = str(root)
    environ.pop("PYTHONDONTWRITEBYTECODE", None)
    return root


M_ARENA_MAX = -8  # glibc's <malloc.h> parameter number of mallopt's arena limit


def one_malloc_arena(environ: Mapping[str, str]) -> bool:
    """Limit glibc's malloc to one arena for this process (``mallopt(M_ARENA_MAX, 1)``), unless the environment
    sets the limit itself (``MALLOC_ARENA_MAX``, or ``glibc.malloc.arena_max`` in ``GLIBC_TUNABLES``); True when
    the limit was set. Does nothing outside Linux, and nothing where the C library's ``mallopt`` ignores it (musl).

    Why: `metrics` reduces steps on worker threads (`metrics.engine`, `metrics.tables`), and glibc gives each
    thread an arena of its own; the memory a chunk's arrays leave free in one arena cannot serve the next chunk's
    arrays in another, so the process held ~0.2 GiB more at its peak on 10M tokens (docs/benchmarks.md, "Metrics
    on the CPU"). With one arena the freed memory is reused and fewer pages are touched for the first time. The
    threads allocate a few large arrays each, so they do not queue on the arena's lock. Call it before any
    thread starts; numbers are unchanged (only where arrays live).
    """
    tunables = environ.get("GLIBC_TUNABLES", "")
    if not sys.platform.startswith("linux") or "MALLOC_ARENA_MAX" in environ or "arena_max" in tunables:
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, 1))


def exit_now(code: int) -> NoReturn:
    """End this process with exit status `code` as the interpreter would, without its teardown.

    What runs, in the interpreter's order: the wait for non-daemon threads (where one is still running, the
    ordinary ``sys.exit`` is taken instead), the ``atexit`` handlers (logging's flush and close, multiprocessing's
    children, ...), the flush of stdout and stderr (Python's and the C library's); then ``os._exit(code)``. What is skipped: freeing every module
    and object one by one, and the C++ destructors (torch's allocators handing GPU and pinned memory back, the CUDA
    context's destruction), about a second after a recompute on an H200 (docs/benchmarks.md, "Start-up: the warm
    fixed cost"): the kernel reclaims the same memory at once when the process ends. Every file pgdiag writes is
    closed and renamed before the command returns, so nothing is lost. Where the interpreter's exit would differ
    (stdout already closed: a broken pipe; a torch.distributed process group still up), the ordinary exit runs.
    """
    if _running_threads() or _process_group_up():
        sys.exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # a closed pipe or stream: reported as the interpreter always has
        sys.exit(code)
    atexit._run_exitfuncs()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):  # closed by a handler's output: the interpreter's status for it
        os._exit(120)
    _flush_c_streams()
    os._exit(code)


def _flush_c_streams() -> None:
    """``fflush(NULL)``: what C libraries printed through stdio (buffered when stdout is a pipe) goes out, as
    ``exit()`` would have sent it."""
    import ctypes

    try:
        ctypes.CDLL(None).fflush(None)
    except (OSError, AttributeError):
        return


def _running_threads() -> bool:
    """True while a non-daemon thread other than this one runs (the interpreter would wait for it)."""
    current = threading.current_thread()
    return any(t is not current and t.is_alive() and not t.daemon for t in threading.enumerate())


def _process_group_up() -> bool:
    """True when torch.distributed has a process group that was not destroyed."""
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def main() -> None:
    """Console-script entry point (`pgdiag`)."""
    one_malloc_arena(os.environ)
    bytecode_cache(os.environ)
    exit_now(run())
