"""Choosing placements for every node: propagation of the user's annotations, the global (MILP through HiGHS) and
greedy planners, cost models, clustering, and auto-sharding under a memory budget.
"""
