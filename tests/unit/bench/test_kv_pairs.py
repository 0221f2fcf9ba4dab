"""bench.kv_pairs without Ray or devices: which worker sends to which in each topology, which op of
each worker belongs to which pair, and the per-pair and aggregate bandwidth arithmetic."""

from __future__ import annotations

import pytest

from bench.kv_pairs import TOPOLOGIES, bandwidth, topology_pairs, transfer_spans, worker_ops

MIB = 1 << 20


@pytest.mark.parametrize(
    ("num_workers", "name", "expected"),
    [
        (2, "single", [(0, 1)]),
        (8, "single", [(0, 1)]),
        (2, "disjoint", [(0, 1)]),
        (4, "disjoint", [(0, 1), (2, 3)]),
        (8, "disjoint", [(0, 1), (2, 3), (4, 5), (6, 7)]),
        (5, "disjoint", [(0, 1), (2, 3)]),  # odd: the last worker idles
        (2, "fan-in", [(1, 0)]),
        (4, "fan-in", [(1, 0), (2, 0), (3, 0)]),
        (8, "fan-in", [(i, 0) for i in range(1, 8)]),
        (4, "fan-out", [(0, 1), (0, 2), (0, 3)]),
        (8, "fan-out", [(0, i) for i in range(1, 8)]),
    ],
)
def test_topology_pairs(num_workers: int, name: str, expected: list[tuple[int, int]]) -> None:
    assert topology_pairs(name, num_workers) == expected


def test_disjoint_pairs_share_no_worker_and_fans_share_one() -> None:
    for g in (2, 4, 8):
        used = [w for pair in topology_pairs("disjoint", g) for w in pair]
        assert sorted(used) == list(range(g))
        assert {r for _, r in topology_pairs("fan-in", g)} == {0}
        assert {s for s, _ in topology_pairs("fan-out", g)} == {0}


def test_fan_width() -> None:
    assert topology_pairs("fan-in", 8, fan_width=3) == [(1, 0), (2, 0), (3, 0)]
    assert topology_pairs("fan-out", 8, fan_width=2) == [(0, 1), (0, 2)]
    assert topology_pairs("disjoint", 8, fan_width=2) == [(0, 1), (2, 3), (4, 5), (6, 7)]  # fans only
    for width in (0, 8):
        with pytest.raises(ValueError, match="fan_width must be between 1 and num_workers - 1 = 7"):
            topology_pairs("fan-in", 8, fan_width=width)


def test_bad_topology_or_size() -> None:
    with pytest.raises(ValueError, match="unknown topology 'ring'"):
        topology_pairs("ring", 4)
    with pytest.raises(ValueError, match="num_workers must be at least 2"):
        topology_pairs("single", 1)
    assert set(TOPOLOGIES) == {"single", "disjoint", "fan-in", "fan-out"}


def test_worker_ops() -> None:
    assert worker_ops(topology_pairs("fan-in", 4)) == {
        1: [(0, "send")], 2: [(0, "send")], 3: [(0, "send")],
        0: [(1, "recv"), (2, "recv"), (3, "recv")],
    }
    assert worker_ops(topology_pairs("disjoint", 4)) == {0: [(1, "send")], 1: [(0, "recv")],
                                                          2: [(3, "send")], 3: [(2, "recv")]}
    with pytest.raises(ValueError, match="cannot send to itself"):
        worker_ops([(1, 1)])


def test_spans_take_the_later_start_and_end_and_the_right_column() -> None:
    pairs = topology_pairs("fan-in", 4)  # w1, w2, w3 -> w0; w0's row: [start, end from w1, w2, w3]
    rows = {
        0: [[10.0, 11.0, 12.0, 13.0], [20.0, 21.5, 22.5, 23.5]],
        1: [[10.5, 10.9], [19.0, 21.0]],  # iteration 0: w1 posted later; its end earlier than w0 saw it
        2: [[9.0, 12.2], [20.0, 22.0]],
        3: [[9.5, 13.0], [20.0, 24.0]],  # iteration 1: w3 saw the end later
    }
    assert transfer_spans(pairs, rows) == [
        [(10.5, 11.0), (20.0, 21.5)],
        [(10.0, 12.2), (20.0, 22.5)],
        [(10.0, 13.0), (20.0, 24.0)],
    ]
    with pytest.raises(ValueError, match="w1 ran 1 iterations, w0 2"):
        transfer_spans(pairs, {**rows, 1: rows[1][:1]})


def test_bandwidth_per_pair_median_and_aggregate() -> None:
    size = 64 * MIB
    # pair A: 3 transfers of 1, 2 and 4 ms back to back from t=0 -> median 2 ms; pair B: 2 ms each from t=0.5 ms
    a = [(0.000, 0.001), (0.001, 0.003), (0.003, 0.007)]
    b = [(0.0005, 0.0025), (0.0025, 0.0045), (0.0045, 0.0065)]
    result = bandwidth(size, [a, b])
    assert result["per_pair_median_gbps"] == pytest.approx([size / 0.002 / 1e9, size / 0.002 / 1e9])
    assert result["per_pair_p10_gbps"][0] == pytest.approx(size / 0.004 / 1e9)  # the slowest of 3
    assert result["per_pair_p90_gbps"][0] == pytest.approx(size / 0.001 / 1e9)  # the fastest of 3
    assert result["sum_of_pairs_gbps"] == pytest.approx(2 * size / 0.002 / 1e9)
    assert result["bytes_moved"] == 6 * size
    assert result["span_s"] == pytest.approx(0.007)  # first begin 0 to last end 7 ms
    assert result["aggregate_gbps"] == pytest.approx(6 * size / 0.007 / 1e9)


def test_aggregate_of_pairs_that_do_not_overlap_is_not_their_sum() -> None:
    one = [(0.0, 0.001)] * 4
    later = [(0.001, 0.002)] * 4  # runs only once the first pair has finished
    result = bandwidth(MIB, [one, later])
    assert result["sum_of_pairs_gbps"] == pytest.approx(2 * MIB / 0.001 / 1e9)
    assert result["aggregate_gbps"] == pytest.approx(8 * MIB / 0.002 / 1e9)
