"""The studies: one module each, run as ``python -m experiments.<name>`` (see :mod:`kernapprox.sweep`)."""

import os
import sys

if sys.argv[:1] == ["-m"]:
    # `python -m experiments.<name>`: an interrupt that arrives before the engine's command line has started (while
    # the study's imports run) ends as one that arrives later does: with a message and the exit status 130. The
    # engine's own handling (kernapprox.sweep.run_cli) takes over once the run begins.
    _previous_hook = sys.excepthook

    def _interrupted(kind, value, traceback):
        if kind is not None and issubclass(kind, KeyboardInterrupt):
            sys.stderr.write("\ninterrupted; the cells finished so far are saved in the result store "
                             "(kernapprox.store): rerun the same command to resume\n")
            sys.stderr.flush()
            os._exit(130)
        _previous_hook(kind, value, traceback)

    sys.excepthook = _interrupted
