"""``python -m anygpu.cli ...`` is the ``anygpu`` command."""

from . import main

if __name__ == "__main__":
    main()
