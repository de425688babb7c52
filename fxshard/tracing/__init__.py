"""From a model or function to one global ATen graph: ``torch.export`` of the forward, the joint forward/backward
graph, per-op tracing, stop-gradients, the checks on Python state a trace bakes in, and activation recompute
policies.
"""
