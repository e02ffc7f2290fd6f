"""The `raypar` console script (issue 45, item 9): SIGTERM and Ctrl-C are handled before the CLI is imported.

Importing the CLI (argparse, the config schema and rules, pathlib, json: ~0.1 s on an idle machine, ~0.4 s on
a loaded one; `python -X importtime -c "import raypar.controller.cli"`) used to come before its handler, and a
SIGTERM then ended the process by the default action, without a line. Here the handler is installed by the
first code of raypar's that runs, after importing only `raypar.controller.stopping` (signal and threading),
and a stop during the rest of the start is one line and 143 (130 for Ctrl-C).

What no handler can cover: the interpreter's own start (its runtime, site.py with the environment's .pth
files, the console script's `import sys`) runs before any code of raypar's. A SIGTERM then meets the default
action: the process ends by signal 15 with no line. That window is the cost of `python -c pass` plus this
module's import (tests/unit/test_sigterm_entry.py measures it).
"""

from __future__ import annotations

from raypar.controller import stopping


def main() -> int:
    try:
        stopping.install()
        from raypar.controller import cli  # the imports the handler now covers

        return cli.main()
    except KeyboardInterrupt:  # a stop while the CLI was imported (cli.main says its own)
        return stopping.say_stop()
