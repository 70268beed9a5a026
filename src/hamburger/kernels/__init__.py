"""Kernels under the decoder: quantized and packed linear layers (fp16, int8, int4), the fused projections, and the
custom operators that let `torch.compile` trace a base pass. Imports nothing of hamburger but errors."""
