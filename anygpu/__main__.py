"""``python -m anygpu`` is ``anygpu doctor``; ``python -m anygpu COMMAND ...`` runs any command."""

import sys

from .cli import cli, main

if __name__ == "__main__":
    args = sys.argv[1:]
    main(args if args and args[0] in cli.commands else ["doctor", *args])
