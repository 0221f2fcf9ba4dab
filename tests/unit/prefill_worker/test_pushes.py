"""PushLog: the totals since start add up every push that ended well (count, bytes, seconds from the
first token, the sends' own device time), and count the ones that did not apart."""

from __future__ import annotations

import pytest

from prefill_worker.pushes import PushLog
from protocol.messages import PushRecordMsg


def test_totals_add_up_the_pushes_and_count_the_failed_apart() -> None:
    log = PushLog()
    log.pushed(PushRecordMsg(request_id="a", push_bytes=1000, push_s=0.010, send_device_s=0.002))
    log.pushed(PushRecordMsg(request_id="b", push_bytes=3000, push_s=0.030, send_device_s=0.004))
    log.ended(failed=True)
    log.ended(failed=False)
    t = log.totals
    assert (t.num_pushed, t.push_bytes, t.num_failed, t.num_cancelled) == (2, 4000, 1, 1)
    assert t.push_seconds == pytest.approx(0.040) and t.send_device_seconds == pytest.approx(0.006)
    assert [r.request_id for r in log.records] == ["a", "b"]
