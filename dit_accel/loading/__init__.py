"""Getting weights onto the device: one block's tensors from a sharded safetensors checkpoint
(`checkpoint`), a block built from them or with synthetic weights (`block`), and blocks kept in
pinned host memory and streamed onto the GPU (`offload`)."""
