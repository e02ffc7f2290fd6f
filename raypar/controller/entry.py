"""The `raypar` console script (issue 45, item 9): SIGTERM and Ctrl-C are handled before the CLI is imported.

Importing the CLI (argparse, the config schema and rules, pathlib, json: `python -X importtime -c "import
raypar.controller.cli"`, 70 ms on a lightly loaded 2-core machine, 370 ms on a heavily loaded one) used to
come before its handler, and a SIGTERM then ended the process by the default action, without a line. Here the
handler is installed by the first code of raypar's that runs, after importing only
`raypar.controller.stopping` (signal and threading: 4 ms in all), and a stop during the rest of the start is
one line and 143 (130 for Ctrl-C).

What no handler can cover: the interpreter's own start (its runtime, site.py with the environment's .pth
files, the console script's `import sys`) runs before any code of raypar's. A SIGTERM then meets the default
action: the process ends by signal 15 with no line. SIGTERM sent 0-160 ms after the start, 5 tries per 20 ms
step, on the same machine (load ~12, `python -c pass` 42 ms): the old entry died silently up to 120-160 ms,
this one up to 20-40 ms, and said its line from 40 ms on.
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
