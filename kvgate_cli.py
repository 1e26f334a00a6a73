"""The ``kvgate`` command's entry point (``[project.scripts]``): SIGHUP ignored before
anything else is imported, then :func:`extproc.cli.main`.

SIGHUP's default action ends the process. ``kvgate serve`` installs its reload handler once
it serves; before this module, the first thing the command ran was importing ``extproc``
and its dependencies (pydantic, grpc, …: ~0.2 s), and a SIGHUP sent meanwhile — a
config-management tool that reloads right after it starts the process — killed it. Here it
is ignored from the first line the interpreter runs for ``kvgate`` (what comes before, the
interpreter's own start, is beyond any Python program's reach: the launcher must ignore the
signal to close that too), and ``--workers``' workers inherit it. ``python -m extproc.cli``
does the same as soon as that package is imported.

SIGTERM likewise, where its default action does nothing (a container's PID 1): it ends the
process from here until ``serve`` or ``agent`` takes it over
(:func:`extproc.processes.exit_on_sigterm_while_starting`).

SIGINT (Ctrl-C) during those imports ends the command with status 130, as it does from
:func:`extproc.cli.main` on; it printed a KeyboardInterrupt traceback from whichever
import it landed in.
"""

import signal

signal.signal(signal.SIGHUP, signal.SIG_IGN)

import sys  # noqa: E402

try:
    from extproc.processes import exit_on_sigterm_while_starting

    exit_on_sigterm_while_starting()

    from extproc.cli import main
except KeyboardInterrupt:  # Ctrl-C during the imports: exit 130 as main() does, no traceback
    sys.exit(130)

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
