"""The multi-node recipe (docs/guides/multi_node.md, issue 32 item 2), run as written: two torchrun
"nodes" (one rank each) meet at a c10d rendezvous on loopback and train 2 steps of `shardkit train`
with --verify. The page's own block runs, in a network namespace holding only the loopback
interface (unshare --net), so nothing listens beyond loopback; the ranks must agree with each
other (the run completes on both nodes) and with the one-process reference (--verify parity)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

import shardkit

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guides" / "multi_node.md"


def _loopback_block() -> str:
    """The page's ```bash block that runs two nodes under ``unshare --net``."""
    blocks = re.findall(r"^```bash\n(.*?)^```", PAGE.read_text(), re.S | re.M)
    found = [b for b in blocks if b.startswith("unshare --net")]
    assert len(found) == 1, "docs/guides/multi_node.md: one bash block starting 'unshare --net'"
    return found[0]


def _can_unshare() -> str | None:
    """None if this process may make a network namespace with loopback up, else why not."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return "needs unshare and ip (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "--net", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    return None if probe.returncode == 0 else f"cannot make a network namespace here: {probe.stderr.strip()}"


def test_the_page_is_in_the_nav_and_the_index():
    assert "guides/multi_node.md" in (ROOT / "mkdocs.yml").read_text()
    assert "guides/multi_node.md" in (ROOT / "docs" / "index.md").read_text()
    block = _loopback_block()
    for flag in ("--nnodes 2", "--rdzv-backend c10d", "--rdzv-endpoint 127.0.0.1:", "-m shardkit train", "--verify"):
        assert flag in block


@pytest.mark.slow  # two torch processes and a rendezvous: 38 s at load 13 on the 2-core machine
def test_two_nodes_on_loopback_train_and_verify(tmp_path):
    why = _can_unshare()
    if why is not None:
        pytest.skip(why)  # not a pass: the recipe is then unchecked on this machine
    src = str(Path(shardkit.__file__).resolve().parents[1])  # this checkout's package, not an installed one
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TORCHELASTIC_RUN_ID", None)
    done = subprocess.run(
        ["bash", "-c", _loopback_block()], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    report = json.loads((tmp_path / "two-nodes" / "report.json").read_text())
    assert report["layout"]["nproc"] == 2 and report["layout"]["tp"] == 2
    assert len(report["losses"]) == 2 and report["losses"] == report["reference_losses"]
    assert report["parity"]["passed"] is True
    assert "PASSED" in done.stdout and done.stdout.count("verify (") == 1  # rank 0 alone reports
    # both nodes' ranks ran (tp 2 spans them: the parity above needs both); a good run leaves no
    # heartbeat files behind (issue 32)
    assert not (tmp_path / "two-nodes" / "flight").exists()
