"""Tools for developing fxshard itself: the numerical validator of sharding rules (``python -m
fxshard.devtools.validate``).
"""
