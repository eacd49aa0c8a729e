"""Kernel tests run the Triton kernels on CPU through the interpreter (DESIGN.md §8), or
natively on CUDA when a GPU is present and TRITON_INTERPRET is not set to 1.

The variable must be set before triton is first imported, hence at import of this conftest.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
