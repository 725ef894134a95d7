"""``python -m anygpu`` is ``anygpu doctor``."""

from .cli import main

if __name__ == "__main__":
    main(["doctor", *__import__("sys").argv[1:]])
