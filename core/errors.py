"""User-facing failures: one clear line and a non-zero exit, never a traceback."""
import contextlib
import errno
import os
import signal
import sys
from typing import Callable, NoReturn, Sequence

EXIT_USER_ERROR = 2


class UserError(Exception):
    """A problem the user can fix. Its message says what is wrong and what to do."""


@contextlib.contextmanager
def alike_on_every_rank():
    """A UserError raised inside is one every process of a torchrun node raises alike (a setting, a file
    they share): only local rank 0 prints it, so the user reads it once, not once per process."""
    try:
        yield
    except UserError as e:
        e.quiet = os.environ.get("LOCAL_RANK", "0") != "0"
        raise


class Stopped(Exception):
    """Work ended early by SIGTERM/SIGINT (core.runtime.StopFlag) at a point with nothing to save: exit
    128 + the signal's number, as a shell reports a process a signal ended."""

    def __init__(self, signal_name: str, where: str):
        super().__init__(f"stopped by {signal_name} {where}")
        self.signal_name = signal_name


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)
# How libraries that write outside Python report it: safetensors (Rust's io::Error), a DCP shard's failure.
DISK_FULL_TEXT = ("No space left on device", "Disk quota exceeded", "os error 28", "os error 122")


def is_disk_full(e: BaseException | None) -> bool:
    """Whether e, or an exception it was raised from or during, is a full disk or an exceeded quota."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL or any(t in str(e) for t in DISK_FULL_TEXT):
            return True
        e = e.__cause__ or e.__context__
    return False


def first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an exception's message (its type's name when it has none), for a one-line error."""
    text = str(e).strip()
    return text.splitlines()[0][:limit] if text else type(e).__name__


def _interrupted_at_start(signum, frame) -> NoReturn:
    os.write(2, b"error: interrupted while starting\n")
    os._exit(128 + signum)  # now: half-done imports have nothing to save or clean up


def quiet_start(module_name: str) -> None:
    """Called by a script with its __name__ before its heavy imports (seconds): run as a script, Ctrl-C until run_cli
    starts main exits at once with one line and 130, not a traceback; imported, it does nothing."""
    if module_name == "__main__":
        signal.signal(signal.SIGINT, _interrupted_at_start)


def run_cli(main: Callable[[Sequence[str]], object], argv: Sequence[str] | None = None) -> NoReturn:
    """Run a script's main(argv); turn a UserError (or a full disk) into `error: ...` on stderr and exit 2."""
    argv = sys.argv[1:] if argv is None else argv
    if signal.getsignal(signal.SIGINT) is _interrupted_at_start:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # main's own stop flags take it from here
    try:
        main(argv)
    except UserError as e:
        if not getattr(e, "quiet", False):
            print(f"error: {e}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    except Stopped as e:
        print(e, file=sys.stderr)
        sys.exit(128 + signal.Signals[e.signal_name].value)
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # stdout closed early, e.g. `| head`: not an error worth a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except Exception as e:
        if not is_disk_full(e):  # a full disk anywhere no write of ours expected it (core/fileio.space_for)
            raise
        where = f" writing {e.filename}" if getattr(e, "filename", None) else ""
        print(f"error: no space left on device{where} ({first_line(e)}); free space and run it again", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
    sys.exit(0)
