"""Kernels under the decoder: quantized and packed linear layers (fp16, int8, int4), the fused projections, and the
native CPU kernels. Imports nothing of hamburger but errors."""
