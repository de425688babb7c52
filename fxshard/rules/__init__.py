"""Op rules, one module per op family; importing this package registers them all.

``python -m fxshard.devtools.validate --all-registered`` checks every strategy of every rule against
the unsharded op on simulated ranks (``validate.py``; its hand-made samples: ``validate_samples.py``).
"""

from . import attention, conv, embedding, factory, indexing, linalg, matmul, norm, pointwise, pool, reduction, view  # noqa: F401
from . import random  # noqa: F401
