"""Kernel tests run the Triton kernels on CPU through the interpreter (DESIGN.md §8).

The variable must be set before triton is first imported, hence here and not in a fixture.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
