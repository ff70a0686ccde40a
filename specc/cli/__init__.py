"""The `specc` command line: parser.py (shared flags and error handling), checks.py (inputs checked
before anything loads), run_cmds.py, bundle_cmds.py and model_cmds.py (the subcommands), format.py
(tables). User errors print one `specc: error:` line and exit with code 2."""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
