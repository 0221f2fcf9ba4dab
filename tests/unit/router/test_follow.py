"""WorkerSetFollower hands the Dispatcher a new worker set only when the controller's version changes."""

from __future__ import annotations

import asyncio

from router import Dispatcher, Workers
from router.follow import WorkerSetFollower


def test_follower_takes_new_versions_and_survives_a_failing_controller():
    async def main():
        answers = [(1, {"p0": "P"}, {"d0": "D"}), (1, {"p0": "P"}, {"d0": "D"}), RuntimeError("down"),
                   (2, {"p0": "P"}, {"d1": "D1"})]

        async def fetch():
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
            if isinstance(answer, Exception):
                raise answer
            return answer

        dispatcher = Dispatcher("r", Workers({}, {}))
        follower = WorkerSetFollower(dispatcher, fetch, interval_s=0.01)
        await follower.start()
        assert follower.version == 1 and set(dispatcher.workers.decode) == {"d0"}
        for _ in range(100):  # bounded: a few intervals
            if follower.version == 2:
                break
            await asyncio.sleep(0.01)
        assert follower.version == 2 and set(dispatcher.workers.decode) == {"d1"}
        follower.stop()
        await dispatcher.close()

    asyncio.run(main())
