"""The HAMburger model: the base, the compositional embedder, the micro-step decoder and stop head, slot adapters, the
KV merger, config and checkpoints."""
