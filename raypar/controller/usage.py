"""The CLI's refusal of a command line (`raypar.controller.cli.main`: one line on stderr, exit 2), raised by
the CLI and by its subcommand modules (`prepare_cmd`)."""


class UsageError(Exception):
    pass
