"""The model on its device: weights and their forms, the runner's forward, the CPU kernels, CUDA graphs, the KV cache, sampling."""
