"""Hand-written CPU kernels, compiled on first use (see ``native``)."""
