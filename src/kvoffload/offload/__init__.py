"""The decode benchmark (bench.py) and the `kvoffload profile` / `kvoffload bench` commands (cli.py). The runtime
they measure is kvoffload.runtime."""
