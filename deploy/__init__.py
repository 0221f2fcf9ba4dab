"""`ray up` cluster configs, the Serve config and the application builder. (Issue "Deploy".)"""

__all__: list[str] = []
