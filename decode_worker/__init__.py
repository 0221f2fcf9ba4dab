"""DecodeWorker: KV leases, receiving pushed KV, continuous batching of decodes with preemption,
and (colocated mode) whole requests. Speculative drafting comes with issue "Speculative decoding"."""

from decode_worker.worker import DecodeWorker, DecodeWorkerConfig

__all__ = ["DecodeWorker", "DecodeWorkerConfig"]
