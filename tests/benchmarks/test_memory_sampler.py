"""`benchmarks.memory.TreeSampler`: the peaks of a process tree's resident sets, sampled on a
thread (the benchmarks' memory figures, beside ``VmHWM``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks.memory import TreeSampler

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

CHILD = """
import time
block = bytearray(160 << 20)  # touched: resident
for i in range(0, len(block), 4096):
    block[i] = 1
time.sleep(0.5)
del block
time.sleep(0.3)
"""


def test_a_childs_transient_peak_is_caught_and_kept() -> None:
    with TreeSampler(os.getpid(), interval=0.01) as sampler:
        child = subprocess.Popen([sys.executable, "-c", CHILD])
        child.wait(timeout=60)
    assert child.returncode == 0
    assert sampler.peaks[child.pid] >= 160 << 20  # the peak, though the child freed it and left
    assert sampler.peaks[os.getpid()] > 0  # the root is sampled too


def test_a_sampler_stops_when_left() -> None:
    sampler = TreeSampler(os.getpid(), interval=0.01)
    with sampler:
        pass
    assert not sampler._thread.is_alive()
    assert sampler.peaks[os.getpid()] > 0  # one sample at least: the last, on leaving
