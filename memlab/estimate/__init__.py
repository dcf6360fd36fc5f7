"""Estimate memory before running: data-free runs of a step, and the CUDA kernels they mimic."""
