"""WorkerSetFollower hands the Dispatcher a new worker set only when the controller's version changes."""

from __future__ import annotations

import asyncio

from router import Dispatcher, Workers
from router.follow import WorkerSetFollower


def test_follower_takes_new_versions_and_survives_a_failing_controller():
    async def main():
        # NOTE: the repeated version 1 names another worker: a follower that took it would hand it over
        answers = [(1, {"p0": "P"}, {"d0": "D"}), (1, {"p0": "P"}, {"d9": "D9"}), RuntimeError("down"),
                   (2, {"p0": "P"}, {"d1": "D1"})]
        taken: list[set[str]] = []

        async def fetch():
            answer = answers.pop(0) if len(answers) > 1 else answers[0]
            if isinstance(answer, Exception):
                raise answer
            return answer

        dispatcher = Dispatcher("r", Workers({}, {}))
        def wrap(workers: Workers) -> Workers:
            taken.append(set(workers.decode))
            return workers

        follower = WorkerSetFollower(dispatcher, fetch, interval_s=0.01, wrap=wrap)
        await follower.start()
        assert follower.version == 1 and set(dispatcher.workers.decode) == {"d0"}
        for _ in range(100):  # bounded: a few intervals
            if follower.version == 2:
                break
            await asyncio.sleep(0.01)
        assert follower.version == 2 and set(dispatcher.workers.decode) == {"d1"}
        assert taken == [{"d0"}, {"d1"}]  # handed over once a version; the repeated version 1 was not
        follower.stop()
        await dispatcher.close()

    asyncio.run(main())
