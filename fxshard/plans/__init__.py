"""What users write to say how to shard: ParallelStyles, plans and their resolution to placements, ``constrain``,
other libraries' styles, and Hugging Face plans.
"""
