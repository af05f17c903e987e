"""The training process keeps the memory it frees (pivotrl.training.host_memory): counted as the
page faults of a process that allocates and frees the same 64 MiB block five times. Each case runs
in a fresh interpreter, since the allocator's settings hold for the whole process."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pivotrl.testing import save_tiny_checkpoint

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's allocator only")

BLOCK_PAGES = (64 << 20) // 4096
# Five allocations of a fresh 64 MiB block fault at least once per 2 MiB page even where the
# kernel backs anonymous memory with transparent huge pages; without them, once per 4 KiB page.
FRESH_FAULTS_MIN = 5 * (64 // 2)

LOOP = """
import resource
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
n = 64 << 20
b = b"\\x01" * n
del b
f0 = faults()
for _ in range(5):
    b = b"\\x01" * n  # malloc + every page written
    del b
print("FAULTS", faults() - f0)
"""


def _faults(setup: str) -> int:
    out = subprocess.run([sys.executable, "-c", setup + LOOP], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"})
    assert out.returncode == 0, out.stderr[-2000:]
    return int(next(line for line in out.stdout.splitlines() if line.startswith("FAULTS")).split()[1])


def test_freed_blocks_stay_in_the_process():
    default = _faults("")
    retained = _faults("from pivotrl.training.host_memory import retain_freed_memory\nassert retain_freed_memory()\n")
    assert default >= FRESH_FAULTS_MIN  # every allocation mapped and faulted in afresh
    assert retained <= BLOCK_PAGES // 100  # the same block reused: (almost) no page faulted again


@pytest.mark.parametrize("retain", [True, False])
def test_the_trainer_setting_decides_it(tmp_path: Path, retain: bool):
    ckpt = save_tiny_checkpoint(tmp_path / "model")
    setup = (f"from pivotrl.training.pivotrl import PivotRLTrainer\n"
             f"PivotRLTrainer.build({str(ckpt)!r}, group_size=2, dtype='float32', retain_host_memory={retain})\n")
    faults = _faults(setup)
    if retain:
        assert faults <= BLOCK_PAGES // 100
    else:
        assert faults >= FRESH_FAULTS_MIN
