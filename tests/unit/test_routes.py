"""The engine-side route store (`weights/engine/routes.py`) without vLLM: positions, vLLM's internal ids, freeing,
the byte budget, merging pipeline stages and stitching the segments of a continued request."""

from __future__ import annotations

import json

import numpy as np
import pytest

from megatron_rl.models.routes import decode_routes, encode_routes
from megatron_rl.weights.engine.routes import (
    RouteStore,
    decode,
    external_id,
    merge_worker_routes,
    route_dtype,
    stitch_segments,
)


def _rows(n: int, layers: int, start: int = 0) -> np.ndarray:
    base = np.arange(start, start + n)[:, None, None]
    return ((base + np.arange(layers)[None, :, None] + np.arange(2)[None, None, :]) % 200).astype(np.uint8)


def test_dtypes_and_internal_ids():
    assert route_dtype(8) == np.uint8 and route_dtype(256) == np.uint8 and route_dtype(257) == np.int16
    with pytest.raises(ValueError):
        route_dtype(40000)
    assert external_id("sample-3-0-a1B2c3D4") == "sample-3-0"
    assert external_id("sample-3-0") == "sample-3-0"  # only vLLM's 8-character suffix goes
    assert external_id("abc-deadbeef-12345678") == "abc-deadbeef"
    assert external_id("abc") == "abc"


def test_rows_land_at_their_positions_and_leave_when_fetched():
    store = RouteStore([0, 1], 2, np.uint8)
    store.write("req-0-abcdefgh", np.arange(0, 7), _rows(7, 2))  # the prompt
    for pos in range(7, 10):  # then one decode step each
        store.write("req-0-abcdefgh", np.array([pos]), _rows(1, 2, start=pos))
    got = store.pop(["req-0"])
    assert set(got) == {"req-0"}
    assert got["req-0"]["missing"] == 0 and got["req-0"]["layers"] == [0, 1]
    np.testing.assert_array_equal(decode(got["req-0"]), _rows(10, 2))
    assert store.pop(["req-0"]) == {} and store.describe()["held"] == 0


def test_overwritten_positions_and_gaps():
    store = RouteStore([3], 2, np.uint8)
    store.write("a", np.arange(4), _rows(4, 1))
    store.write("a", np.arange(4), _rows(4, 1, start=50))  # a preempted request computed again
    store.write("a", np.array([6]), _rows(1, 1, start=6))
    entry = store.pop(["a"])["a"]
    assert entry["missing"] == 2  # positions 4 and 5 never computed (a prefix cache would do that)
    np.testing.assert_array_equal(decode(entry)[:4], _rows(4, 1, start=50))


def test_finished_routes_beyond_the_budget_are_evicted_oldest_first():
    store = RouteStore([0], 2, np.uint8, max_finished_bytes=2 * 64 * 2)  # two requests of 64 rows
    for name in ("a", "b", "c"):
        store.write(name, np.arange(10), _rows(10, 1))
    store.write("running", np.arange(10), _rows(10, 1))
    store.finish(["a", "b", "c", "never-seen"])
    assert set(store.pop(["a", "b", "c", "running"])) == {"b", "c", "running"}
    assert store.stats["evicted"] == 1
    store.write("d", np.arange(3), _rows(3, 1))
    assert store.drop(["d", "x"]) == 1 and store.pop(["d"]) == {}


def test_pipeline_stages_merge_by_layer_and_segments_stitch():
    first = RouteStore([0, 2], 2, np.uint8)
    second = RouteStore([5], 2, np.uint8)
    rows = _rows(6, 3)
    first.write("r-x1y2z3w4", np.arange(6), rows[:, [0, 1]])
    second.write("r-x1y2z3w4", np.arange(6), rows[:, [2]])
    tp_peer: dict = {}
    merged = merge_worker_routes([first.pop(["r"]), tp_peer, second.pop(["r"])], "r")
    np.testing.assert_array_equal(merged, rows)
    assert merge_worker_routes([{}], "r") is None
    short = RouteStore([5], 2, np.uint8)
    short.write("r", np.arange(5), rows[:5, [2]])
    again = RouteStore([0, 2], 2, np.uint8)
    again.write("r", np.arange(6), rows[:, [0, 1]])
    with pytest.raises(ValueError, match="stage lengths"):
        merge_worker_routes([again.pop(["r"]), short.pop(["r"])], "r")
    seg0, seg1 = _rows(9, 2), _rows(14, 2, start=100)
    stitched = stitch_segments([seg0, seg1])
    np.testing.assert_array_equal(stitched[:9], seg0)
    np.testing.assert_array_equal(stitched[9:], seg1[9:])


def test_routes_travel_as_json_and_back_bit_for_bit():
    """What a sample carries in the buffer (and its checkpoints): base64 JSON, uint8 or int16, nothing else."""
    for dtype in ("uint8", "int16"):
        rows = np.arange(5 * 3 * 2).reshape(5, 3, 2).astype(dtype)
        entry = json.loads(json.dumps(encode_routes(rows)))
        assert np.array_equal(decode_routes(entry), rows) and decode_routes(entry).dtype == rows.dtype
    with pytest.raises(ValueError, match="int64"):
        encode_routes(np.zeros((2, 1, 2), dtype="int64"))
    bad = encode_routes(np.zeros((2, 1, 2), dtype="uint8")) | {"shape": [3, 1, 2]}
    with pytest.raises(ValueError, match="holds 4 bytes"):
        decode_routes(bad)


def test_kept_sets_round_trip_and_rows_from_processed_logprobs():
    from megatron_rl.models.routes import KEPT_PAD, decode_kept_sets, encode_kept_sets, kept_set_row

    # top_k 3 -> 4 asked: finite entries are the set; -inf ones (outside it) are dropped
    row = kept_set_row({7: -0.1, 3: -2.0, 9: float("-inf"), 5: float("-inf")}, asked=4)
    assert row.dtype == np.int32 and row.tolist() == [3, 7, KEPT_PAD]
    # all asked finite: ties may have kept more than were reported -> unknown
    assert kept_set_row({1: -1.0, 2: -1.0, 3: -1.0, 4: -1.0}, asked=4).tolist() == [KEPT_PAD] * 3
    # the sampled token outside the top asked (one entry more) also means a larger set
    assert kept_set_row({1: -1.0, 2: -1.0, 3: -1.0, 4: -1.0, 8: -3.0}, asked=4).tolist() == [KEPT_PAD] * 3
    with pytest.raises(ValueError, match="at least 2 logprobs"):
        kept_set_row({1: 0.0}, asked=1)
    rows = np.stack([row, np.array([1, 2, 3], dtype=np.int32)])
    entry = json.loads(json.dumps(encode_kept_sets(rows)))
    assert np.array_equal(decode_kept_sets(entry), rows)
    with pytest.raises(ValueError, match="kept sets \\[tokens, width\\] must be of"):
        encode_kept_sets(rows.astype(np.int64))
    with pytest.raises(ValueError, match="kept sets entry"):
        decode_kept_sets({**entry, "shape": [3, 3]})


def test_compact_routes_take_the_smallest_dtype_that_holds_the_ids():
    from megatron_rl.models.routes import compact_routes

    rows = np.array([[[0, 255]], [[3, 4]]], dtype=np.int32)  # vLLM's own output dtype
    assert compact_routes(rows).dtype == np.uint8 and compact_routes(rows).tolist() == rows.tolist()
    assert compact_routes(rows + 1).dtype == np.int16
    with pytest.raises(ValueError, match="does not fit int16"):
        compact_routes(rows * 1000)
    with pytest.raises(ValueError, match="negative expert id"):
        compact_routes(rows - 1)
    with pytest.raises(ValueError, match="integers"):
        compact_routes(rows.astype(np.float32))
