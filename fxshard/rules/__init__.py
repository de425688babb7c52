"""Op rules, one module per op family; importing this package registers them all.

``python -m fxshard.devtools.validate --all-registered`` checks every strategy of every rule against
the unsharded op on simulated ranks (``validate.py``; its hand-made samples: ``validate_samples.py``).
"""

from . import attention
from . import conv
from . import embedding
from . import factory
from . import indexing
from . import matmul
from . import norm
from . import pointwise
from . import pool
from . import reduction
from . import view  # noqa: F401
from . import random  # noqa: F401
