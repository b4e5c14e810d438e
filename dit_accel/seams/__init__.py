"""The seams under the library's layers: what the router, the patches and the offload share without importing each
other. `model_globals.py`: the one reversible, reference-counted swap of a global of a model's file (the attention
router, the SDPA stand-in, the fused RoPE); `counts.py`: call counters that keep counting inside compiled graphs;
`placement.py`: the device a module computes on (streamed blocks included)."""
