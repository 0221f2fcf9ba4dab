"""PrefillWorker: prompt scheduling under a token budget (chunked), prefix cache, first-token
sampling, and the KV push into a decode worker's leased blocks."""

from prefill_worker.config import PrefillWorkerConfig
from prefill_worker.worker import PrefillWorker

__all__ = ["PrefillWorker", "PrefillWorkerConfig"]
