"""`python -m inkling_quant.cli`."""
import sys

from . import main

sys.exit(main())
