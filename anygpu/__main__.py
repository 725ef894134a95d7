"""``python -m anygpu`` is ``anygpu doctor``; ``python -m anygpu COMMAND ...`` runs any command."""

import sys

from .cli import cli, main

if __name__ == "__main__":
    args = sys.argv[1:]
    # A command, or the group's own --help / --version, goes to the group; anything else is doctor's.
    passthrough = args and (args[0] in cli.commands or args[0] in ("--help", "-h", "--version"))
    main(args if passthrough else ["doctor", *args])
