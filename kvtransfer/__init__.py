"""Moving paged KV blocks between workers: the Transport interface (nccl, gloo, local), pairing,
and the block-ownership protocol messages. (Being built: issue "Disaggregation".)"""

__all__: list[str] = []
