"""What users read about a sharding: ``explain``, ``comm_stats`` and ``memory``.
"""
