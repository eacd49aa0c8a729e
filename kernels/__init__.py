"""specserve.kernels: Triton kernels, each beside a plain-torch reference (reference.py)."""
