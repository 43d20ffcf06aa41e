"""The selection machinery the selective policies share (`tokenselect`, `clo`, `extrapolation`), one job per
module: `choose` (the top-k of a vote), `space` (the token space and the pool's token bookkeeping), `cache` (the
selection cache in a layer's slots), `rows` (the selected rows and their sources), `options` (shared options
and budgets), `hooks` (`SelectionHooks`, the layer hooks both build on). Callers import from the modules."""
