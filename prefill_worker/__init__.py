"""PrefillWorker: prompt scheduling under a token budget (chunked), prefix cache, first-token
sampling, the answer to the router, then the KV push into a decode worker's leased blocks. Each
request is a PrefillJob with its states and transitions in prefill_worker/job.py."""

from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.job import JobState, PrefillJob
from prefill_worker.worker import PrefillWorker

__all__ = ["JobState", "PrefillJob", "PrefillWorker", "PrefillWorkerConfig"]
