"""Training state around a sharded module: checkpoints (DCP, safetensors), optimizer state, tiled initialisation,
gradient norms, scaling and the gradient guards.
"""
