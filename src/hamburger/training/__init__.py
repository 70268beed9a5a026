"""Data and training: prompt sources, distillation, entropy segmentation, the teacher cache, training loops and
export."""
