"""The Redis Cluster slot map the failover store watches, read from CLUSTER NODES."""

from __future__ import annotations

from limiter.stores.slots import SlotMap, parse_nodes

NODES = b"""\
aaa 10.0.0.1:6379@16379 myself,master - 0 0 1 connected 0-5460 [5461->-bbb]
bbb 10.0.0.2:6379@16379,redis-b master - 0 1 2 connected 5461-10921
ccc 10.0.0.3:6379@16379 master,nofailover - 0 1 3 connected 10922-16382 16383
ddd 10.0.0.4:6379@16379 slave aaa 0 1 1 connected
eee 10.0.0.5:6379@16379 master,fail - 0 1 4 disconnected
"""


def test_each_slot_has_its_primary() -> None:
    slots = parse_nodes(NODES)
    assert slots.primary(0) == slots.primary(5460) == "aaa"
    assert slots.primary(5461) == "bbb"  # (being migrated from aaa: still bbb's)
    assert slots.primary(16382) == slots.primary(16383) == "ccc"
    assert not slots.suspect  # a failed primary with no slots left (failed over): no
    assert parse_nodes(NODES.decode()) == slots


def test_a_failing_primary_that_serves_slots_is_suspect() -> None:
    for flag in ("fail?", "fail"):
        slots = parse_nodes(NODES.replace(b"master,nofailover", b"master," + flag.encode()))
        assert slots.suspect and slots.primary(16383) == "ccc"


def test_an_uncovered_slot_has_none() -> None:
    assert SlotMap(((0, 10, "a"), (20, 30, "b"))).primary(15) is None
    assert SlotMap(()).primary(0) is None


def test_the_parsed_form_redis_py_gives_is_read_too() -> None:
    parsed = {
        "10.0.0.1:6379": {"node_id": "aaa", "flags": "myself,master",
                          "slots": [["0", "8191"]]},
        "10.0.0.2:6379": {"node_id": "bbb", "flags": "master,fail?",
                          "slots": [["8192", "16383"]]},
        "10.0.0.3:6379": {"node_id": "ccc", "flags": "slave", "slots": []},
    }
    slots = parse_nodes(parsed)
    assert slots == SlotMap(((0, 8191, "aaa"), (8192, 16383, "bbb")), suspect=True)
