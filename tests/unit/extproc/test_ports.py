"""Free ports for the processes tests and benchmarks start."""

import pytest

from extproc.ports import free_port


def test_free_port_never_hands_out_the_same_port_twice():
    """A config takes several ports before anything binds them; the OS may offer one twice."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)


def test_processes_sharing_the_ports_pick_from_parts_that_do_not_meet():
    """Parallel test workers each remember only their own ports: each picks from its own
    part of the range, so none picks a port another picked and has not bound yet."""
    from extproc import ports

    saved = ports._share
    try:
        picked = []
        for index in range(2):
            ports.share_ports(index, 2)
            picked.append({free_port() for _ in range(50)})
    finally:
        ports._share = saved
    assert max(picked[0]) < min(picked[1])
    with pytest.raises(ValueError):
        ports.share_ports(2, 2)
