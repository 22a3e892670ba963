"""Ctrl-C during a capture: one line saying what was written, exit 130, a valid file of the
snapshots taken; ``recover`` of the ``.partial`` that no longer exists says the capture finished."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import kvformat


def test_ctrl_c_during_capture_leaves_the_snapshots_taken(tmp_path: Path, smollm2_dir: Path) -> None:
    output = tmp_path / "run.kv"
    partial = Path(f"{output}.partial")
    command = [sys.executable, "-m", "kvsnap", "capture", "--model", str(smollm2_dir), "--max-tokens", "400",
               "--every", "4", "-o", str(output), "--prompt",
               "The history of the city begins when a small settlement grew up by a bridge"]  # fmt: skip
    run = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's job
    )
    two_snapshots = 900_000 * (2 if smollm2_dir.name.endswith("float32") else 1)  # float32 K/V: twice
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (partial.exists() and partial.stat().st_size > two_snapshots):
        time.sleep(0.2)  # two snapshots or more taken
    assert run.poll() is None, "the capture ended before it could be interrupted"
    run.send_signal(signal.SIGINT)
    _, err = run.communicate(timeout=120)
    assert run.returncode == 130
    assert "Traceback" not in err
    lines = [line for line in err.replace("\r", "\n").splitlines() if line.startswith("kvsnap:")]
    assert len(lines) == 1 and lines[0].startswith(f"kvsnap: interrupted: wrote {output}: ")
    with kvformat.open(output) as snap:
        snap.verify()
        assert f"{snap.num_snapshots} snapshot(s)" in lines[0] and snap.num_snapshots >= 2
    assert not partial.exists()
    recover = subprocess.run(
        [sys.executable, "-m", "kvsnap", "recover", str(partial)],
        capture_output=True,
        text=True,
        env=os.environ,
    )
    assert recover.returncode == 2
    assert f"the capture finished as {output}, nothing to recover" in recover.stderr
    assert len(recover.stderr.strip().splitlines()) == 1
