"""PrefillWorker: prompt scheduling under a token budget, prefix cache, and the KV push to a
decode worker's leased blocks. (Being built: issue "Disaggregation".)"""

__all__: list[str] = []
