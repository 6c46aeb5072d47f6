"""Long work shows progress on a terminal and stays quiet in a pipe (issue 51, item 2)."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from pathlib import Path


def _output(command: list[str], terminal: bool, cwd: Path) -> str:
    """What ``command`` writes to stdout and stderr, attached to a pseudo-terminal or a pipe."""
    if not terminal:
        proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout + proc.stderr
    parent, child = pty.openpty()
    proc = subprocess.Popen(command, cwd=cwd, stdin=child, stdout=child, stderr=child)
    os.close(child)
    chunks = []
    while True:
        try:
            chunk = os.read(parent, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(parent)
    assert proc.wait(timeout=300) == 0, b"".join(chunks)[-2000:]
    return b"".join(chunks).decode(errors="replace")


def test_preprocess_shows_the_tokenizer_training_on_a_terminal_only(tmp_path):
    (tmp_path / "text.txt").write_text("".join(f"line {i} of some words\n" for i in range(3000)))
    for terminal in (True, False):
        out = _output([sys.executable, "-m", "meshtron", "preprocess", "text.txt", "--output",
                       f"out-{terminal}", "--cache-dir", f"cache-{terminal}"], terminal, tmp_path)
        assert ("Tokenize words" in out) is terminal, out[-2000:]
        assert f"wrote out-{terminal}.bin/.idx" in out
