"""Op rules, one module per op family; importing this package registers them all."""

from . import attention, conv, embedding, factory, matmul, norm, pointwise, reduction, view  # noqa: F401
from . import random  # noqa: F401
