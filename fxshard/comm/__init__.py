"""Collectives and their planning: the transition planner (placements -> collectives, priced), the functional
collectives fxshard emits, their lowering, and the cross-rank checks that run through them (consistency,
replicas, failures).
"""
