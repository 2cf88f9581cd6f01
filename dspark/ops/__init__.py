"""Ops: each validates its inputs, computes its launch plan once, and runs either the NumPy
reference (numpy backend) or the csrc/ kernel (simt and cuda executors)."""
