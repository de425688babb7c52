"""The vocabulary every layer shares: errors, placements and specs, meshes, the graph IR's metadata keys,
symbolic shapes, the shard context, progress, autocast state and the one home of private torch names
(``torch_compat``). Imports nothing else of fxshard.
"""
