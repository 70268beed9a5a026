"""Decoding: the one macro-step core, the fast engine, continuous batching, verify and compress modes, the
transformers reference path, sampling, quantization, llama.cpp."""
