"""Getting weights onto the device: one block's tensors from a sharded safetensors checkpoint
(`checkpoint`), a block built from them or with synthetic weights (`block`), and blocks kept in
pinned host memory and streamed onto the GPU (`offload`).

This file imports nothing heavy: the command line reads `OFFLOAD_CHOICES` for its --help."""

OFFLOAD_CHOICES = ("resident", "stream")  # --offload: weights on the device, or streamed from pinned host memory
