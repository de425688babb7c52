"""fxshard's own torch custom ops (the device-neutral attention node) that traced programs call.
"""
