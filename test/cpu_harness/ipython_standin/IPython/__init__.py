"""Import-only IPython stand-in for hosts without IPython (gpu_check.sh only).

``sglang.utils`` does ``from IPython.display import HTML, display`` at import time;
SGLang's server never renders notebook output. ``gpu_check.sh`` puts the parent
directory on ``PYTHONPATH`` only when ``import IPython.display`` fails on the host
(and in ``--dry-run``, to exercise it). Nothing here is IPython code.
"""

__version__ = "0.0.0+kvcr-standin"
__kvcr_standin__ = True
# matplotlib's canvas reads ``sys.modules["IPython"].version_info`` whenever IPython
# was imported; from 8.24 on it leaves IPython alone, which suits a stand-in.
version_info = (8, 24, 0, "")
