"""A torchft replica group SIGKILLed and restarted on the emulated cluster (gradcomp.lab.ft_failure):
the survivors lose at most the step in flight plus 2, the restarted group heals and all end
bit-identical; no namespace, child process or lighthouse is left behind."""

from __future__ import annotations

import os

import pytest

from gradcomp.lab.cluster import PREFIX, requirements_missing

pytest.importorskip("torchft", reason="torchft is not installed (pip install 'gradcomp[ft]')")

REASON = requirements_missing()


def _children() -> set[int]:
    """PIDs of this process's live children (from /proc), less multiprocessing's
    own helpers (the forkserver and resource tracker the link calibration's
    launch starts once per process, as every launch does)."""
    me, out = os.getpid(), set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(fields[1]) == me and fields[0] != "Z" and "from multiprocessing." not in cmd:
            out.add(int(pid))
    return out


def _namespaces() -> list[str]:
    import subprocess

    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30)
    return [line.split()[0] for line in r.stdout.splitlines()
            if line.startswith(f"{PREFIX}{os.getpid()}-")]


@pytest.mark.slow
@pytest.mark.timeout(420)
@pytest.mark.skipif(REASON is not None, reason=f"emulated cluster unavailable: {REASON}")
def test_kill_and_heal_on_a_100mbit_cluster(tmp_path):
    from gradcomp.lab.ft_failure import kill_and_heal

    before = _children()
    res = kill_and_heal("100mbit", target=24, kill_at=6, timeout=180.0, out=str(tmp_path))
    assert res["lost_beyond_in_flight"] <= 2, res
    assert res["lost_beyond_in_flight"] == max(0, res["survivor_failed_steps"] - 1)
    assert res["restarted_first_step"] >= 6  # it healed at the survivors' step, not from step 0
    assert res["bit_identical"], res
    assert res["restart_to_first_commit_s"] > 0 and res["kill_to_survivors_next_commit_s"] > 0
    assert res["link"]["configured_bps"] == 100_000_000 and res["link"]["achieved_bps"] > 0
    # cleaned up: no namespace of this process, no child left (lighthouse and replicas ended by PID)
    assert _namespaces() == []
    assert _children() <= before


def test_kill_and_heal_bad_arguments_name_them():  # checked before any namespace is made
    from gradcomp.lab.ft_failure import kill_and_heal

    with pytest.raises(ValueError, match="kill_at"):
        kill_and_heal(kill_at=0)
    with pytest.raises(ValueError, match="target"):
        kill_and_heal(target=8, kill_at=6)
