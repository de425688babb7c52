"""Analyses of traced programs that planning, passes and reports share: liveness (per-rank memory peaks) and the
memory layouts kernels rely on.
"""
