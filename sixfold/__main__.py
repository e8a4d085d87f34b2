"""python -m sixfold: the command line, as the installed `sixfold` script."""
import sys

from .cli import main

sys.exit(main())
