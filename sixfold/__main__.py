"""python -m sixfold: the command line, as the installed `sixfold` script."""
from .cli import script

if __name__ == "__main__":  # (not as a spawned process imports it)
    script()
