"""``python -m kvoffload.eval ruler|longbench|ppl ...`` (same as ``kvoffload eval ...``, errors included)."""

import sys

from kvoffload.cli import main

sys.exit(main(["eval", *sys.argv[1:]]))
