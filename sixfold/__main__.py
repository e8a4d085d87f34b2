"""python -m sixfold: the command line, as the installed `sixfold` script."""
from .cli import script

script()
