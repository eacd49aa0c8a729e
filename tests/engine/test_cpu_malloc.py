"""glibc malloc settings (specserve/cpu_malloc.py), each check in a fresh interpreter: the
settings are process-wide and must not leak into the other tests' timings."""

import subprocess
import sys
import textwrap

import pytest

from specserve import cpu_malloc

pytestmark = pytest.mark.skipif(cpu_malloc._libc() is None, reason="glibc only (the settings are a no-op elsewhere)")


def run(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


FAULTS_PER_ALLOCATION = """
    import resource, torch
    def faults_per_allocation():
        for _ in range(3):                      # whatever glibc learns from the first frees
            torch.ones(4 << 20).sum()
        faults = []
        for _ in range(21):
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            torch.ones(4 << 20).sum()           # 16 MiB, allocated, written, freed
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        # The median allocation: once in a while the whole heap is faulted in afresh
        # (4096 faults in one of 20 allocations, in a full test run only), which says
        # nothing about what each allocation costs.
        return sorted(faults)[10]
"""


def test_big_temporaries_stop_faulting_pages_in_once_the_heap_is_kept():
    # glibc with its start-up threshold pinned (as a fresh process has it for a while): every
    # 16 MiB tensor is a fresh mmap, ~4096 page faults each time. With the settings: none.
    out = run(FAULTS_PER_ALLOCATION + """
    import ctypes
    from specserve import cpu_malloc
    libc = cpu_malloc._libc()
    libc.mallopt(cpu_malloc.M_MMAP_THRESHOLD, 128 << 10)
    print(faults_per_allocation())
    assert cpu_malloc.keep_large_allocations_on_heap()
    print(faults_per_allocation())
    """)
    default, kept = map(float, out.split())
    assert default > 3000
    assert kept < 50


def test_engine_applies_it_on_the_cpu_unless_turned_off(tmp_path):
    out = run("""
    from specserve import LLM, cpu_malloc
    LLM(dtype="float32", progress=False, cpu__heap_malloc=False, draft="none", num_blocks=64)
    print(cpu_malloc._applied)
    LLM(dtype="float32", progress=False, draft="none", num_blocks=64)
    print(cpu_malloc._applied)
    """)
    assert out.split() == ["False", "True"]
