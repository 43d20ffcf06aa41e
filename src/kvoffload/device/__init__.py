"""The device layer: memory kinds and host <-> device transfers (memory.py), the tensor-parallel mesh and where
every array lives on it (sharding.py). A leaf: it imports nothing of kvoffload above `errors`."""
