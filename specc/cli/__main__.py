"""`python -m specc.cli`: the specc command line."""
import sys

from . import main

sys.exit(main())
