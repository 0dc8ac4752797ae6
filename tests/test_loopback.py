"""Every socket the tool listens on is on the loopback interface: the pool's TCPStore has no
authentication (whoever reaches it can read and write the group's keys), and gloo's pairs
accept whoever connects. Spawned ranks are on one host, whatever the environment names."""

import os
import subprocess
import sys

import pytest

from helpers import descendants, exposed, listening, wait_gone

POOL = """
import time
from tpdp_verify.ranks.pool import RankPool
if __name__ == "__main__":
    with RankPool(2, "gloo") as pool:
        pool.run(sum, [1, 2])  # the group is formed: gloo's pairs listen
        print("up", flush=True)
        time.sleep(600)
"""


def _default_route_interface() -> str | None:
    """The interface a multi-host run would name (GLOO_SOCKET_IFNAME), from /proc/net/route."""
    with open("/proc/net/route") as f:
        routes = [line.split() for line in f.readlines()[1:]]
    return next((cols[0] for cols in routes if cols[1] == "00000000"), None)


@pytest.mark.timeout(120)
def test_a_pools_store_and_ranks_listen_on_loopback_only_whatever_the_environment_names(tmp_path):
    script = tmp_path / "pool_script.py"
    script.write_text(POOL)
    other = _default_route_interface()
    env = {**os.environ} | ({"GLOO_SOCKET_IFNAME": other, "NCCL_SOCKET_IFNAME": other} if other else {})
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline() == "up\n", "the pool did not start"
        tree = descendants(proc.pid)
        listeners = listening(tree)
        found = exposed(tree)
    finally:
        proc.kill()
        proc.wait()
    assert wait_gone(tree) == []
    assert listeners[proc.pid], "the parent's TCPStore does not listen"
    assert sum(bool(socks) for pid, socks in listeners.items() if pid != proc.pid) == 2, listeners  # gloo's
    assert found == {}, f"listening beyond the loopback interface (environment named {other}): {found}"
