from helpers import torchrun


def test_process_groups_have_the_right_members():
    """8 gloo ranks, dp_shard2 x cp2 x tp2 with ep2: every named group's members are checked by all-gather."""
    proc = torchrun("groups.py", 8, "dp_shard=2", "cp=2", "tp=2", "ep=2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "groups OK" in proc.stdout
