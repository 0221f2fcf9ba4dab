"""DecodeWorker: KV leases, continuous batching of decodes, preemption, speculative drafting.
(Being built: issue "Disaggregation".)"""

__all__: list[str] = []
