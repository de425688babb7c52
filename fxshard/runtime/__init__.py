"""What runs per rank: ``ShardedModule`` and the pieces it is built from (programs, the autograd bridge, stand-
ins, call-time checks, state interop), parameter sources and input checks.
"""
