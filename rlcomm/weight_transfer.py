"""Compatible alias of :mod:`rlcomm.weights`, kept for code that imports from here.

``from rlcomm.weight_transfer import WeightSender, WeightReceiver`` goes on working: this module
only re-exports the public names of :mod:`rlcomm.weights`, where the code and the wire protocol
now live. New code imports from :mod:`rlcomm.weights`.
"""

from rlcomm.weights import *  # noqa: F403
from rlcomm.weights import __all__ as __all__
