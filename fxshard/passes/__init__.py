"""The pipeline's lowering stages (redistribute, localize, in-place, bucket, overlap, emit, verify) and
``pipeline.py``, which lists the stages in order. Stages do not import each other.
"""
