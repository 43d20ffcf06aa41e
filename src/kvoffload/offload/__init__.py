"""The offload runtime: the paged block pool (pool.py) and the layer pipeline every pool policy runs on
(pipeline.py). Memory kinds, transfers and sharding live in kvoffload.device; planning (pool sizes, memory
checks, cost model, schedulers) in kvoffload.plan."""
