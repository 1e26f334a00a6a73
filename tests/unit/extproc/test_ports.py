"""Free ports for the processes tests and benchmarks start."""

from extproc.ports import free_port


def test_free_port_never_hands_out_the_same_port_twice():
    """A config takes several ports before anything binds them; the OS may offer one twice."""
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
