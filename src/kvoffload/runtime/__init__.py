"""The runtime every pool policy runs on: the paged block pool (pool.py) and the layer pipeline (pipeline.py and
the modules it is built from; docs/ARCHITECTURE.md "Layout" lists them). Memory kinds, transfers and sharding live
in kvoffload.device; planning (pool sizes, memory checks, cost model, schedulers) in kvoffload.plan."""
