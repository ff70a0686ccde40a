"""`python -m specc`: the specc command line."""
import sys

from .cli import main

sys.exit(main())
