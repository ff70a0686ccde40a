"""The mathematics of speculation, shared below the passes and the runtime: sampling and the
lossless acceptance rules (chain and tree), as plain tensor functions that also export into graphs."""
