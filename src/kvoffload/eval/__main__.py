"""``python -m kvoffload.eval ruler|longbench|ppl ...`` (same as ``kvoffload eval ...``)."""

import sys

from kvoffload.eval.cli import cli_main

sys.exit(cli_main())
